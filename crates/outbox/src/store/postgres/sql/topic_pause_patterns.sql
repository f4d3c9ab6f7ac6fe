SELECT pattern FROM {s}.topic_pauses
