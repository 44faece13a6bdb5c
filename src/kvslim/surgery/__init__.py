"""Model surgery: MHA -> GQA/MQA conversion, its calibration and alignment."""
