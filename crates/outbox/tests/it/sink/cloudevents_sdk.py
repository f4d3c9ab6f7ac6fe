"""Decodes one message with the official CloudEvents Python SDK (package `cloudevents`,
2.2 or later) and prints what the SDK read, as JSON, for the `cloudevents` tests.

Input (stdin), one JSON object:
  {"binding": "http" | "kafka" | "amqp" | "json" | "mqtt",
   "headers": {name: text}          # HTTP headers, Kafka record headers, AMQP
                                    # application properties, MQTT user properties
   "content_type": text | null,     # AMQP content-type / MQTT Content Type property
   "key": text | null,              # Kafka record key
   "body_base64": text}             # body / value / application data / payload

Output (stdout): {"sdk": version, "events": [{"api": name, "attributes": {...},
"data": {"kind": "none" | "bytes" | "text" | "json", "value": ...}}, ...]}: one entry
per SDK API that reads the binding (the 2.x `cloudevents.core` bindings and, where
there is one, the 1.x-compatible `cloudevents.v1` API). `time` is printed in ISO 8601;
bytes data as base64. Any SDK error is an exit status of 1 with the error on stderr.
"""

import base64
import json
import sys

try:
    import cloudevents
    from cloudevents.core.bindings import amqp, http, kafka
    from cloudevents.core.formats.json import JSONFormat
    from cloudevents.core.v1.event import CloudEvent
    from cloudevents.v1 import http as v1_http
    from cloudevents.v1 import kafka as v1_kafka
    from dateutil.parser import isoparse
except ImportError as e:  # pragma: no cover - reported to the Rust test
    sys.stderr.write(
        f"the CloudEvents Python SDK is not installed ({e}): "
        "python3 -m pip install 'cloudevents>=2.2,<3' (scripts/test does)\n"
    )
    sys.exit(3)


def text(value):
    if hasattr(value, "isoformat"):
        return value.isoformat()
    return value if isinstance(value, str) else str(value)


def data_of(data):
    if data is None:
        return {"kind": "none"}
    if isinstance(data, (bytes, bytearray)):
        return {"kind": "bytes", "value": base64.b64encode(bytes(data)).decode()}
    if isinstance(data, str):
        return {"kind": "text", "value": data}
    return {"kind": "json", "value": data}


def entry(api, attributes, data):
    return {
        "api": api,
        "attributes": {k: text(v) for k, v in attributes.items()},
        "data": data_of(data),
    }


def main():
    msg = json.load(sys.stdin)
    binding = msg["binding"]
    headers = msg.get("headers") or {}
    body = base64.b64decode(msg.get("body_base64") or "")
    events = []
    if binding == "http":
        event = http.from_http_event(http.HTTPMessage(headers=headers, body=body))
        events.append(entry("core.http", event.get_attributes(), event.get_data()))
        legacy = v1_http.from_http(headers, body, data_unmarshaller=lambda d: d)
        events.append(entry("v1.http", legacy.get_attributes(), legacy.get_data()))
    elif binding == "kafka":
        raw = {k: v.encode() for k, v in headers.items()}
        key = msg.get("key")
        event = kafka.from_kafka_event(kafka.KafkaMessage(headers=raw, key=key, value=body))
        events.append(entry("core.kafka", event.get_attributes(), event.get_data()))
        legacy_msg = v1_kafka.KafkaMessage(headers=raw, key=key, value=body)
        if any(k.lower().startswith("ce_") for k in raw):
            legacy = v1_kafka.from_binary(legacy_msg, data_unmarshaller=lambda d: d)
        else:
            legacy = v1_kafka.from_structured(legacy_msg, data_unmarshaller=lambda d: d)
        events.append(entry("v1.kafka", legacy.get_attributes(), legacy.get_data()))
    elif binding == "amqp":
        properties = {}
        if msg.get("content_type") is not None:
            properties["content-type"] = msg["content_type"]
        event = amqp.from_amqp_event(
            amqp.AMQPMessage(
                properties=properties,
                application_properties=headers,
                application_data=body,
            )
        )
        events.append(entry("core.amqp", event.get_attributes(), event.get_data()))
    elif binding == "json":
        event = JSONFormat().read(None, body)
        events.append(entry("core.json", event.get_attributes(), event.get_data()))
    elif binding == "mqtt":
        # No MQTT binding in the SDK: the binding's mapping (user properties named as the
        # attributes, Content Type = datacontenttype) into the SDK's validating event.
        attributes = dict(headers)
        if "time" in attributes:
            attributes["time"] = isoparse(attributes["time"])
        if msg.get("content_type") is not None:
            attributes["datacontenttype"] = msg["content_type"]
        data = JSONFormat().read_data(body, attributes.get("datacontenttype"))
        event = CloudEvent(attributes, data)
        events.append(entry("core.event", event.get_attributes(), event.get_data()))
    else:
        raise SystemExit(f"unknown binding {binding!r}")
    json.dump({"sdk": cloudevents.__version__, "events": events}, sys.stdout)


if __name__ == "__main__":
    main()
