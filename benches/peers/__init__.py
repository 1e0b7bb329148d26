"""The implementations the benches measure groupmm against, one module per peer."""
