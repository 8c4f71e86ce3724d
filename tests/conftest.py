"""Shared fixtures. Tests never need a GPU; multi-process tests fork gloo ranks with autopar.launch."""
