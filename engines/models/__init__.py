"""Model definitions (dense, MoE, hybrid linear attention), building tiny ones, weight names and checkpoint reading."""
