"""Model surgery: training, MHA -> GQA/MQA conversion, uptraining, evaluation."""
