"""Triton kernels of the built-in engine (each with a torch reference path)."""
