"""Hot loops. Each module holds one family of kernels; see docs/architecture.md."""
