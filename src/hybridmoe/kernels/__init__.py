"""Python face of the C++ expert kernels (csrc/), with a pure-torch reference for every op."""
