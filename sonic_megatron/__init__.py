"""sonic-megatron: SonicMoE's IO-aware, tile-aware MoE kernels and expert-parallel dispatch for
Megatron-core. Sub-packages: ``sonic_megatron.kernels`` (one device's experts), ``sonic_megatron.
token_dispatch`` (expert-parallel all-to-all), and the Megatron glue in this package."""

__version__ = "0.1.0"
