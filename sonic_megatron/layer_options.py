"""``LayerOptions``: one MoE layer's options, resolved once when the layer is built.

``SonicMoELayer`` resolves ``SonicConfig`` (``SONIC_MEGATRON_*`` overrides applied) against Megatron's config into
one frozen ``LayerOptions`` and hands that object to everything it builds: the router (which outputs to give),
the experts (kernel backend and activation, weight-gradient pairs) and the dispatch mode (token_dispatch's
options, the rounding policy). Nothing below the layer reads ``SonicConfig`` or the environment again.

The experts backend is decided here too, per layer, from the layer's config (``layer_backend``): ``ep.backend`` is
always ``torch`` or ``cute``, never ``auto``, so no kernel is reached to find out what runs.
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import SonicConfig, env_var, expert_ffn_per_rank, kernels_activation, validate_megatron_config
from .kernels import BACKENDS, backends
from .token_dispatch import EPOptions, TokenRounding


@dataclass(frozen=True)
class LayerOptions:
    """Attributes:
    sonic: the plugin options with their environment overrides applied.
    ep: token_dispatch's options of this layer: the kernels' ``activation`` (from Megatron's activation) and
        ``backend`` (``torch`` or ``cute``: ``layer_backend``'s choice for this layer), ``num_chunks``,
        ``comm_sms``, ``redispatch_x_in_backward``. Its ``rounding`` is None and its
        ``wgrad`` None: rounding applies in training only (``rounding`` below), and the deferred weight
        gradients belong to the experts that record them (``SonicExperts.ep_options``).
    rounding: the token rounding applied in training, None for plain top-K.
    """

    sonic: SonicConfig
    ep: EPOptions
    rounding: TokenRounding | None

    @classmethod
    def resolve(cls, sonic_config: SonicConfig | None, config, *, check_megatron: bool) -> LayerOptions:
        """``sonic_config`` (defaults if None) with its environment overrides, for Megatron's ``config``;
        ``check_megatron``: first refuse the Megatron options the plugin's layer does not compute
        (``validate_megatron_config``; experts built alone by a stock MoELayer check only the activation). Either
        way the experts backend is decided here (``layer_backend``)."""
        sonic = SonicConfig.resolve(sonic_config)
        activation = validate_megatron_config(config, sonic) if check_megatron else kernels_activation(config)
        ep = EPOptions(
            activation=activation,
            backend=layer_backend(sonic.backend, config, activation),
            num_chunks=sonic.num_chunks,
            comm_sms=sonic.comm_sms,
            redispatch_x_in_backward=sonic.redispatch_x_in_backward,
        )
        rounding = TokenRounding(sonic.token_rounding, sonic.rounding_tile) if sonic.rounding_enabled else None
        return cls(sonic=sonic, ep=ep, rounding=rounding)

    @property
    def sonic_dispatch(self) -> bool:
        """Tokens travel through token_dispatch (``SonicConfig.dispatcher='sonic'``), not Megatron's dispatcher."""
        return self.sonic.dispatcher == "sonic"


def layer_backend(choice: str, config, activation: str) -> str:
    """The experts backend, ``torch`` or ``cute``, of a layer with Megatron's ``config`` and the kernels'
    ``activation``, decided when the layer is built from the cute backend's rule (``kernels/backends.py``): the
    activation, ``params_dtype``, ``hidden_size`` and the expert ffn size of one rank (``moe_ffn_hidden_size`` /
    the expert tensor-parallel size) against the GEMMs' alignment, the local
    expert count and the current CUDA device (where Megatron trains, also after ``--use-cpu-initialization``),
    then whether the backend imports.

    ``choice`` (``SonicConfig.backend``): ``torch`` is kept; ``auto`` gives ``cute`` where it runs this layer, else
    ``torch`` with one warning naming the reason (once per reason, not per layer); ``cute`` where it cannot run
    this layer raises ValueError naming the option, its allowed values and the reason (on an untested Blackwell GPU it
    runs, with one warning saying so)."""
    if choice == "torch":
        return "torch"
    ffn = expert_ffn_per_rank(config)
    num_experts = getattr(config, "num_moe_experts", None)
    ep = getattr(config, "expert_model_parallel_size", 1) or 1
    capability = backends.current_device_capability()
    reason = (
        backends.cute_unsupported_reason(
            activation,
            config.params_dtype,
            config.hidden_size,
            ffn,
            capability,
            num_experts=num_experts // ep if num_experts else None,
            explicit=choice == "cute",
        )
        or backends.cute_import_reason()
    )
    if reason is None:
        note = backends.untested_device_note(capability)
        if note is not None:
            backends.warn_once(f"sonic_megatron: SonicConfig.backend='cute': {note}")
        return "cute"
    if choice == "cute":
        raise ValueError(
            f"sonic_megatron: SonicConfig.backend='cute' ({env_var('backend')}) cannot run this layer: {reason}. "
            f"SonicConfig.backend takes one of {BACKENDS}: 'auto' uses cute where it runs and torch elsewhere, "
            "'torch' runs anywhere"
        )
    backends.warn_once(f"sonic_megatron: SonicConfig.backend='auto' uses the torch backend for this layer: {reason}")
    return "torch"
