"""The CPU platform (platform.py) and its kernels: C++ sources in csrc/ built on first use (kernels.py), weight
layouts for them (packed.py, int4.py, int8.py), the fused decode layer (decode_layer.py) and the instruction-set
variants (kernel_variants.py). The device-neutral interface a vendor implements is the rest of platforms/."""
