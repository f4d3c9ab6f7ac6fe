//! `envelope::from_mqtt`: an MQTT 5 publish whose user properties are the input's header
//! pairs, in order (a `content-type` pair is also the Content Type property, as the sink
//! writes it); without pairs, a publish without properties (MQTT 3.1.1).
#![no_main]
use libfuzzer_sys::fuzz_target;
use rumqttc::v5::mqttbytes::QoS;
use rumqttc::v5::mqttbytes::v5::{Publish, PublishProperties};

fuzz_target!(|data: &[u8]| {
    let (pairs, body) = outbox_fuzz::split(data);
    let pairs = outbox_fuzz::text_pairs(&pairs);
    let mut publish = Publish::new("outbox/fuzz", QoS::AtLeastOnce, body.to_vec(), None);
    if !pairs.is_empty() {
        let properties = PublishProperties {
            content_type: pairs
                .iter()
                .find(|(n, _)| n.eq_ignore_ascii_case("content-type"))
                .map(|(_, v)| (*v).to_owned()),
            user_properties: pairs
                .iter()
                .map(|(n, v)| ((*n).to_owned(), (*v).to_owned()))
                .collect(),
            ..PublishProperties::default()
        };
        publish.properties = Some(properties);
    }
    let _ = outbox::envelope::from_mqtt(&publish);
});
