"""Running a trained model without training it: KV-cache generation."""
