"""Integrations with transformers and Accelerate."""
