"""The Megatron-core trainer (issue #5): model building, HF <-> Megatron weights, ..."""
