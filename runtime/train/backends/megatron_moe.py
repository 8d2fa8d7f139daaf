"""Mixture-of-experts (MoE) layers under ``--train-backend megatron``: the HF config's experts and router as
megatron-core's (``MoELayer`` on the local spec: a router, the alltoall token dispatcher, ``SequentialMLP`` experts, or
:class:`GroupedGemmExperts` under ``--moe-grouped-gemm``), their weights both ways, and slime's MoE flags.

Pure functions over plain dicts and tensors, except :class:`GroupedGemmExperts` (megatron-core, imported where it is
built): ``rlcore-run --dry-run`` reads this module without megatron-core.

Families (:data:`MOE_READERS`): Qwen3-MoE (``qwen3_moe``): a softmax router over ``num_experts`` experts, top
``num_experts_per_tok``, renormalised over the top k when ``norm_topk_prob`` (Megatron's ``moe_router_pre_softmax``
false: a softmax over the top-k logits is the same), else not (``moe_router_pre_softmax`` true: the softmax over all
experts, top k taken as they are); no shared expert; every layer MoE.

Weights (layer ``L``, Megatron's stage-local ``i``; ``E`` experts over ``ep`` expert-parallel ranks, rank ``r``
holds global experts ``[r * E / ep, (r + 1) * E / ep)`` as local ``0 .. E / ep - 1``; experts are not split over
tensor-parallel ranks, ``--expert-tensor-parallel-size 1``):

=================================================================  ==================================================
Megatron                                                           HF (checkpoint names, the wire layout)
=================================================================  ==================================================
``decoder.layers.i.mlp.router.weight``                             ``model.layers.L.mlp.gate.weight`` [E, H]
``decoder.layers.i.mlp.experts.local_experts.j.linear_fc1.weight`` ``mlp.experts.e.gate_proj.weight`` and
                                                                   ``up_proj.weight``, stacked [gate; up]
``decoder.layers.i.mlp.experts.local_experts.j.linear_fc2.weight`` ``mlp.experts.e.down_proj.weight``
=================================================================  ==================================================
"""

from __future__ import annotations

import ast
import functools
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported where tensors are used: the config's checks read this module torch-free
    import torch


@dataclass(frozen=True)
class MoEShape:
    """The MoE part of a model, in Megatron's terms (``TransformerConfig``'s ``moe_*`` fields)."""

    num_experts: int
    router_topk: int
    ffn_hidden_size: int
    # Megatron's moe_router_pre_softmax: the softmax over all experts, top k kept unnormalised (HF norm_topk_prob
    # false); false: a softmax over the top-k logits (HF's renormalised top k).
    pre_softmax: bool
    # 1 where a decoder layer is MoE, 0 where it is dense (Megatron's --moe-layer-freq as a list).
    layer_pattern: tuple[int, ...]
    score_function: str = "softmax"
    # The shared experts' summed width (Megatron's moe_shared_expert_intermediate_size: n_shared_experts x
    # moe_intermediate_size); None: no shared expert.
    shared_ffn_hidden_size: int | None = None
    # A per-expert bias added to the scores for the choice only (Megatron's expert_bias, HF's e_score_correction_bias).
    expert_bias: bool = False
    # Multiplies the gate weights (Megatron's moe_router_topk_scaling_factor, HF's routed_scaling_factor).
    topk_scaling_factor: float | None = None
    # Group-limited routing: experts in num_groups groups, tokens routed within the best group_topk (None: off).
    num_groups: int | None = None
    group_topk: int | None = None


def _qwen3_moe(hf: Mapping[str, Any], source: str) -> MoEShape:
    layers = int(hf["num_hidden_layers"])
    problems = []
    # transformers 5 writes num_experts as num_local_experts (its attribute map); the released checkpoints num_experts.
    experts = hf.get("num_experts", hf.get("num_local_experts"))
    missing = [key for key in ("num_experts_per_tok", "moe_intermediate_size") if hf.get(key) is None]
    missing += [] if experts is not None else ["num_experts"]
    if missing:
        raise ValueError(f"{source}: missing {', '.join(missing)} (a qwen3_moe config)")
    step = int(hf.get("decoder_sparse_step") or 1)
    dense = sorted(int(i) for i in hf.get("mlp_only_layers") or [])
    pattern = tuple(int(i not in dense and (i + 1) % step == 0) for i in range(layers))
    if 0 in pattern:
        problems.append(
            f"dense layers among the MoE ones (decoder_sparse_step {step}, mlp_only_layers {dense}): the backend "
            "builds every layer as MoE"
        )
    topk, norm = int(hf["num_experts_per_tok"]), bool(hf.get("norm_topk_prob", False))
    if topk == 1 and norm:
        problems.append(
            "num_experts_per_tok 1 with norm_topk_prob true (a gate weight of exactly 1, which megatron-core's "
            "router does not compute: it takes the softmax over all experts at top-1)"
        )
    if problems:
        raise ValueError(f"{source}: --train-backend megatron cannot build this model: " + "; ".join(problems))
    return MoEShape(
        num_experts=int(experts),
        router_topk=topk,
        ffn_hidden_size=int(hf["moe_intermediate_size"]),
        pre_softmax=not norm,
        layer_pattern=pattern,
    )


def _sigmoid_router(hf: Mapping[str, Any], source: str) -> MoEShape:
    """GLM-4.5's and DeepSeek-V3's MoE: a sigmoid router with a per-expert bias for the choice (the gate weights are
    the unbiased scores of the chosen experts, renormalised and scaled), optionally group-limited; shared experts;
    the first ``first_k_dense_replace`` layers dense."""
    required = ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size")
    missing = [key for key in required if hf.get(key) is None]
    if missing:
        raise ValueError(f"{source}: missing {', '.join(missing)} (a {hf.get('model_type')} config)")
    layers, experts = int(hf["num_hidden_layers"]), int(hf["n_routed_experts"])
    topk, width = int(hf["num_experts_per_tok"]), int(hf["moe_intermediate_size"])
    dense = int(hf.get("first_k_dense_replace") or 0)
    step = int(hf.get("moe_layer_freq") or 1)
    pattern = tuple(int(i >= dense and i % step == 0) for i in range(layers))
    groups, group_topk = int(hf.get("n_group") or 1), int(hf.get("topk_group") or 1)
    problems = []
    if step != 1:
        problems.append(f"moe_layer_freq {step} (transformers builds every layer past the dense ones as MoE)")
    if not hf.get("norm_topk_prob", False) and topk > 1:
        problems.append("norm_topk_prob false (megatron-core's sigmoid router always renormalises its top k)")
    if topk == 1:
        problems.append("num_experts_per_tok 1 (megatron-core's sigmoid router does not renormalise a single expert)")
    if hf.get("topk_method", "noaux_tc") != "noaux_tc":
        problems.append(f"topk_method {hf['topk_method']!r} (only noaux_tc: sigmoid scores with the expert bias)")
    if groups > 1:
        # Megatron scores a group by the sum of its top topk // group_topk experts, transformers by its top 2.
        if experts % groups:
            problems.append(f"n_routed_experts {experts} not a multiple of n_group {groups}")
        elif topk // group_topk != 2:
            problems.append(
                f"n_group {groups} with num_experts_per_tok {topk} and topk_group {group_topk}: megatron-core scores "
                f"a group by its top {topk // group_topk} experts, transformers by its top 2"
            )
    shared = int(hf.get("n_shared_experts") or 0)
    if problems:
        raise ValueError(f"{source}: --train-backend megatron cannot build this model: " + "; ".join(problems))
    return MoEShape(
        num_experts=experts,
        router_topk=topk,
        ffn_hidden_size=width,
        # Megatron reads moe_router_pre_softmax for softmax routers only.
        pre_softmax=False,
        layer_pattern=pattern,
        score_function="sigmoid",
        shared_ffn_hidden_size=shared * width if shared else None,
        expert_bias=True,
        topk_scaling_factor=float(hf.get("routed_scaling_factor") or 1.0),
        num_groups=groups if groups > 1 else None,
        group_topk=group_topk if groups > 1 else None,
    )


# model_type -> the reader of its MoE fields (ValueError naming what cannot be built).
MOE_READERS: dict[str, Callable[[Mapping[str, Any], str], MoEShape]] = {
    "qwen3_moe": _qwen3_moe,
    "glm4_moe": _sigmoid_router,
    "deepseek_v3": _sigmoid_router,
}


def moe_from_hf(hf: Mapping[str, Any], *, source: str = "config.json") -> MoEShape | None:
    """The :class:`MoEShape` of an HF config (a dict), None for a dense family."""
    reader = MOE_READERS.get(hf.get("model_type"))
    return None if reader is None else reader(hf, source)


class _LayerFreq(ast.NodeVisitor):
    """Megatron's ``--moe-layer-freq`` expressions: list literals of ints, ``+`` and ``*`` (``[0]*3+[1]*45``)."""

    def visit(self, node: ast.AST) -> Any:
        if isinstance(node, ast.Expression):
            return self.visit(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.List):
            return [self.visit(e) for e in node.elts]
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add | ast.Mult):
            left, right = self.visit(node.left), self.visit(node.right)
            return left + right if isinstance(node.op, ast.Add) else left * right
        raise ValueError(f"not a list of 0/1 or an int: {ast.unparse(node)}")


def layer_pattern(freq: int | str, *, num_layers: int) -> tuple[int, ...]:
    """Megatron's ``--moe-layer-freq`` (an int N: every N-th layer MoE, from layer 0; or a list expression such as
    ``[0]*1+[1]*47`` or ``[1, 1, 0]``) as 1/0 per layer; ``ValueError`` naming the flag otherwise."""
    try:
        value = freq if isinstance(freq, int) else _LayerFreq().visit(ast.parse(str(freq).strip(), mode="eval"))
    except (SyntaxError, ValueError, TypeError) as err:
        raise ValueError(f"--moe-layer-freq {freq!r}: {err}") from None
    if isinstance(value, int):
        if value < 1:
            raise ValueError(f"--moe-layer-freq {freq!r}: an int must be >= 1")
        return tuple(int(i % value == 0) for i in range(num_layers))
    if len(value) != num_layers or any(v not in (0, 1) for v in value):
        raise ValueError(f"--moe-layer-freq {freq!r}: want {num_layers} entries of 0 or 1, got {value}")
    return tuple(value)


# ------------------------------------------------------------------ weights

# The stacked expert weights of GroupedGemmExperts by parameter name, and the per-expert linear each stacks: the
# checkpoint, the weight mapping and the expert mark see ``local_experts.j.<linear>.weight`` as SequentialMLP has it.
STACKED_EXPERTS = {"weight1": "linear_fc1", "weight2": "linear_fc2"}
_LINEARS = "|".join(STACKED_EXPERTS.values())
_EXPERT = re.compile(rf"mlp\.experts\.local_experts\.(\d+)\.({_LINEARS})\.weight")
# GroupedGemmExperts' stacked parameters (every local expert of a layer in one).
_STACKED_EXPERT = re.compile(rf"mlp\.experts\.({'|'.join(STACKED_EXPERTS)})$")
ROUTER = "mlp.router.weight"
# The router's expert bias: a float32 buffer of megatron-core's router, not a parameter (updated by the token counts
# at --moe-router-bias-update-rate, never by the optimizer).
EXPERT_BIAS = "mlp.router.expert_bias"
HF_EXPERT_BIAS = "mlp.gate.e_score_correction_bias"
# The shared experts: one MLP, split over tensor-parallel ranks as a dense MLP is.
SHARED_FC1 = "mlp.shared_experts.linear_fc1.weight"
SHARED_FC2 = "mlp.shared_experts.linear_fc2.weight"


def is_expert(name: str) -> bool:
    """Whether a Megatron tensor name (with or without its ``decoder.layers.i.`` prefix) is an expert's weight, or
    :class:`GroupedGemmExperts`' stack of a layer's local experts' weights."""
    return _EXPERT.search(name) is not None or _STACKED_EXPERT.search(name) is not None


def mark_expert_grads(model: Any) -> None:
    """Mark every expert weight of ``model`` for the expert-data-parallel gradient reduction (megatron-core's
    ``allreduce = False``, which its DDP and optimizer read).

    megatron-core marks experts so only under expert parallelism (EP > 1), and otherwise reduces them over the
    data-parallel group like dense weights. With experts whole on each tensor-parallel rank (EP = 1,
    ``--expert-tensor-parallel-size 1`` below ``--tensor-model-parallel-size``) under sequence parallelism, each TP
    rank routes its own chunk of the sequence to its copy of every expert, so an expert's gradient is the sum over the
    TP ranks too: the expert-data-parallel group's (which holds them), not the data-parallel one's. Marked, they are
    reduced there at any EP, as the CPU path (``MegatronSteps._optimizer_step``) reduces them."""
    for name, param in model.named_parameters():
        if is_expert(name):
            param.allreduce = False


def local_experts(moe: MoEShape, *, ep_size: int) -> int:
    """Experts per expert-parallel rank; ``ValueError`` unless ``ep_size`` divides the experts."""
    if ep_size < 1 or moe.num_experts % ep_size:
        raise ValueError(
            f"--expert-model-parallel-size {ep_size} must divide num_experts {moe.num_experts} (each rank holds "
            "whole experts)"
        )
    return moe.num_experts // ep_size


def hf_moe_shapes(moe: MoEShape, *, hidden_size: int, prefix: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """HF name -> (shape, the config fields that size it) of one MoE layer's MLP; ``prefix`` is ``model.layers.L.``."""
    e, h, f = moe.num_experts, hidden_size, moe.ffn_hidden_size
    out = {prefix + "mlp.gate.weight": ((e, h), "num_experts, hidden_size")}
    if moe.expert_bias:
        out[prefix + HF_EXPERT_BIAS] = ((e,), "n_routed_experts")
    if moe.shared_ffn_hidden_size is not None:
        s, why = moe.shared_ffn_hidden_size, "n_shared_experts x moe_intermediate_size"
        p = f"{prefix}mlp.shared_experts."
        out[p + "gate_proj.weight"] = ((s, h), f"{why}, hidden_size")
        out[p + "up_proj.weight"] = ((s, h), f"{why}, hidden_size")
        out[p + "down_proj.weight"] = ((h, s), f"hidden_size, {why}")
    for i in range(e):
        p = f"{prefix}mlp.experts.{i}."
        out[p + "gate_proj.weight"] = ((f, h), "moe_intermediate_size, hidden_size")
        out[p + "up_proj.weight"] = ((f, h), "moe_intermediate_size, hidden_size")
        out[p + "down_proj.weight"] = ((h, f), "hidden_size, moe_intermediate_size")
    return out


def moe_to_megatron(
    hf: Mapping[str, torch.Tensor],
    moe: MoEShape,
    *,
    hf_prefix: str,
    prefix: str,
    ep_rank: int,
    ep_size: int,
    tp_rank: int = 0,
    tp_size: int = 1,
) -> dict[str, torch.Tensor]:
    """One MoE layer's Megatron tensors (names under ``prefix``, ``decoder.layers.i.``) of expert-parallel rank
    ``ep_rank`` and tensor-parallel rank ``tp_rank`` (the shared experts' shard; routed experts are whole) from the HF
    tensors under ``hf_prefix`` (``model.layers.L.``). Tensors are new (clones)."""
    import torch

    count = local_experts(moe, ep_size=ep_size)
    out = {prefix + ROUTER: hf[hf_prefix + "mlp.gate.weight"].clone()}
    if moe.expert_bias:
        out[prefix + EXPERT_BIAS] = hf[hf_prefix + HF_EXPERT_BIAS].clone()
    if moe.shared_ffn_hidden_size is not None:
        p = f"{hf_prefix}mlp.shared_experts."
        gate, up = (hf[p + n].chunk(tp_size, dim=0)[tp_rank] for n in ("gate_proj.weight", "up_proj.weight"))
        out[prefix + SHARED_FC1] = torch.cat([gate, up])
        out[prefix + SHARED_FC2] = hf[p + "down_proj.weight"].chunk(tp_size, dim=1)[tp_rank].clone()
    for j in range(count):
        p = f"{hf_prefix}mlp.experts.{ep_rank * count + j}."
        m = f"{prefix}mlp.experts.local_experts.{j}."
        out[m + "linear_fc1.weight"] = torch.cat([hf[p + "gate_proj.weight"], hf[p + "up_proj.weight"]])
        out[m + "linear_fc2.weight"] = hf[p + "down_proj.weight"].clone()
    return out


def expert_to_hf(
    name: str, ep_parts: Sequence[torch.Tensor], moe: MoEShape, *, layer: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """HF tensors of the local-expert tensor ``name`` (without ``decoder.layers.i.``) of every expert-parallel rank:
    ``ep_parts[r]`` is rank ``r``'s, whose local expert ``j`` is global expert ``r * E / ep + j``."""
    match = _EXPERT.fullmatch(name)
    if match is None:
        raise ValueError(f"not an expert tensor: decoder.layers.*.{name}")
    count = local_experts(moe, ep_size=len(ep_parts))
    local, kind = int(match.group(1)), match.group(2)
    for rank, part in enumerate(ep_parts):
        p = f"model.layers.{layer}.mlp.experts.{rank * count + local}."
        if kind == "linear_fc1":
            gate, up = part.chunk(2, dim=0)
            yield p + "gate_proj.weight", gate
            yield p + "up_proj.weight", up
        else:
            yield p + "down_proj.weight", part


# A torch_dist checkpoint's whole expert tensor of one layer (megatron-core's SequentialMLP stores the local experts
# of every EP rank as one tensor with the global expert index first: [E, ...]).
_WHOLE_EXPERTS = re.compile(r"mlp\.experts\.experts\.(linear_fc1|linear_fc2)\.weight")


def split_whole_experts(rest: str, value: torch.Tensor) -> dict[str, torch.Tensor] | None:
    """``{local-spec name (without decoder.layers.i.): expert e's tensor}`` of a checkpoint's whole expert tensor
    ``rest`` of one layer (``[E, ...]``); None for any other tensor."""
    match = _WHOLE_EXPERTS.fullmatch(rest)
    if match is None:
        return None
    return {f"mlp.experts.local_experts.{e}.{match.group(1)}.weight": value[e] for e in range(value.shape[0])}


# ------------------------------------------------------------------ megatron-core

# --moe-router-load-balancing-type values megatron-core 0.16.1 takes that leave the routes as the router scores them
# (sinkhorn re-balances the routes themselves, which transformers' models do not).
LOAD_BALANCING_BUILT = ("aux_loss", "seq_aux_loss", "global_aux_loss", "none")


def transformer_config_kwargs(moe: MoEShape, train: Any, *, dp_size: int = 1) -> dict[str, Any]:
    """The ``moe_*`` fields of megatron-core's ``TransformerConfig`` for ``moe`` trained as ``train`` (a
    ``TrainConfig``: expert parallelism and slime's MoE training flags) over ``dp_size`` data-parallel ranks (the
    balancing loss's coefficient may depend on it: :func:`megatron_aux_loss_coeff`)."""
    kind, coeff = train.moe_router_load_balancing_type, train.moe_aux_loss_coeff
    return {
        "moe_shared_expert_intermediate_size": moe.shared_ffn_hidden_size,
        "moe_router_enable_expert_bias": moe.expert_bias,
        "moe_router_bias_update_rate": train.moe_router_bias_update_rate,
        "moe_router_topk_scaling_factor": moe.topk_scaling_factor,
        "moe_router_num_groups": moe.num_groups,
        "moe_router_group_topk": moe.group_topk,
        "num_moe_experts": moe.num_experts,
        "moe_router_topk": moe.router_topk,
        "moe_ffn_hidden_size": moe.ffn_hidden_size,
        "moe_router_pre_softmax": moe.pre_softmax,
        "moe_router_score_function": moe.score_function,
        "moe_layer_freq": list(moe.layer_pattern),
        "moe_router_load_balancing_type": train.moe_router_load_balancing_type,
        "moe_aux_loss_coeff": megatron_aux_loss_coeff(kind, coeff, dp_size=dp_size),
        "moe_router_dtype": train.moe_router_dtype,
        "moe_token_drop_policy": train.moe_token_drop_policy,
        "moe_token_dispatcher_type": train.moe_token_dispatcher_type,
        # The legacy GroupedMLP wants the grouped_gemm package; --moe-grouped-gemm selects GroupedGemmExperts in the
        # spec instead (megatron_attention.local_layer_spec).
        "moe_grouped_gemm": False,
        "expert_model_parallel_size": train.expert_model_parallel_size,
        "expert_tensor_parallel_size": train.expert_tensor_parallel_size,
    }


@functools.cache
def grouped_gemm_experts() -> type:
    """:class:`GroupedGemmExperts`, megatron-core imported here."""
    import torch
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
    from megatron.core.fusions.fused_bias_swiglu import weighted_bias_swiglu_impl
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
    from megatron.core.transformer.module import MegatronModule

    class GroupedGemmExperts(MegatronModule):
        """A layer's local experts (SwiGLU MLPs without biases) as two stacked parameters, ``weight1 [E, 2F, H]``
        (each expert's ``linear_fc1.weight``, ``[gate; up]``) and ``weight2 [E, H, F]`` (``linear_fc2.weight``),
        computed by ``torch._grouped_mm``: one matrix product over all local experts for each of the two layers,
        the tokens of each expert one group (``offs``: the cumulative token counts). No copy of the weights per
        micro-batch and one gradient per layer, where megatron-core's ``SequentialMLP`` loops over experts after a
        host sync. Its checkpoint is ``SequentialMLP``'s (the same ``torch_dist`` keys and global tensors, global
        expert index first), so either module loads the other's; :func:`model_tensors` names each expert's slice
        as ``SequentialMLP`` names its weight. The gate weights (``probs``) scale the activation, as
        ``SequentialMLP``'s experts apply them."""

        def __init__(self, num_local_experts: int, config: Any, submodules: Any = None, pg_collection: Any = None):
            super().__init__(config=config)
            if not config.gated_linear_unit or config.activation_func is not torch.nn.functional.silu:
                raise ValueError("--moe-grouped-gemm: the experts must be SwiGLU MLPs (gated SiLU)")
            if config.add_bias_linear or pg_collection.expt_tp.size() != 1:
                raise ValueError("--moe-grouped-gemm: experts without biases, whole on each rank (ETP 1)")
            self.num_local_experts = num_local_experts
            self.ep_group, self.dp_group = pg_collection.ep, pg_collection.expt_dp
            ffn, hidden = config.moe_ffn_hidden_size, config.hidden_size
            device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
            kw = {"dtype": config.params_dtype, "device": device}
            self.weight1 = torch.nn.Parameter(torch.empty(num_local_experts, 2 * ffn, hidden, **kw))
            self.weight2 = torch.nn.Parameter(torch.empty(num_local_experts, hidden, ffn, **kw))
            if config.perform_initialization:
                with torch.no_grad():
                    for e in range(num_local_experts):
                        config.init_method(self.weight1[e])
                        config.output_layer_init_method(self.weight2[e])
            # As SequentialMLP's column- and row-parallel linears mark theirs at ETP 1 (a one-rank split), and for
            # the expert-data-parallel gradient reduction (mark_expert_grads marks them at any EP).
            set_tensor_model_parallel_attributes(self.weight1, is_parallel=True, dim=1, stride=1)
            set_tensor_model_parallel_attributes(self.weight2, is_parallel=True, dim=2, stride=1)
            self.register_load_state_dict_post_hook(_drop_sequential_extra_state)

        def forward(
            self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor, permuted_probs: Any
        ) -> tuple[torch.Tensor, None]:
            x = permuted_local_hidden_states
            offs = torch.cumsum(tokens_per_expert.to(x.device), 0).to(torch.int32)
            gate_up = grouped_mm(x, self.weight1.transpose(1, 2), offs=offs)
            if self.config.bias_activation_fusion:
                # megatron-core's fused SwiGLU weighted by the gates (torch.compile'd; on GPUs, where
                # --bias-swiglu-fusion turns it on, as it does for SequentialMLP's experts): one kernel each way
                # where the eager ops below run five forward and more backward.
                act = weighted_bias_swiglu_impl(gate_up, None, permuted_probs.unsqueeze(-1))
            else:
                gate, up = gate_up.chunk(2, dim=-1)
                act = (torch.nn.functional.silu(gate) * up * permuted_probs.unsqueeze(-1)).to(x.dtype)
            return grouped_mm(act, self.weight2.transpose(1, 2), offs=offs), None

        def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Any = None) -> dict:
            """``SequentialMLP``'s checkpoint entries: per stacked weight one ``ShardedTensor`` of this rank's experts
            at their global index, under ``SequentialMLP``'s key; its linears' empty extra states alike.
            megatron-core's ``singleton_local_shards`` layout (one key per expert) is not built: asked for, it is
            refused."""
            if (metadata or {}).get("singleton_local_shards", False):
                raise ValueError(
                    "--moe-grouped-gemm: the stacked experts save megatron-core's default torch_dist layout, not "
                    "singleton_local_shards (one key per expert)"
                )
            ep_rank, ep_size = self.ep_group.rank(), self.ep_group.size()
            replica = (0, 0, self.dp_group.rank())  # replicas along expert-data-parallel ranks, as SequentialMLP's
            axis = len(sharded_offsets)  # the global expert index follows any prepended axes (layers)
            outer_shape = tuple(size for _, _, size in sharded_offsets)
            outer_at = tuple(at for _, at, _ in sharded_offsets)
            experts = self.num_local_experts * ep_size
            out: dict[str, Any] = {}
            for name, linear in STACKED_EXPERTS.items():
                key = f"{prefix}experts.{linear}"
                out[f"{prefix}{name}"] = ShardedTensor.from_rank_offsets(
                    f"{key}.weight",
                    getattr(self, name),
                    *sharded_offsets,
                    (axis, ep_rank, ep_size),
                    replica_id=replica,
                    prepend_axis_num=axis,
                )
                for j in range(self.num_local_experts):
                    at = (*outer_at, ep_rank * self.num_local_experts + j)
                    out[f"{prefix}local_experts.{j}.{linear}._extra_state"] = ShardedObject(
                        f"{key}._extra_state", None, (*outer_shape, experts), at, replica
                    )
            return out

        def expert_views(self) -> dict[str, torch.Tensor]:
            """Each local expert's weights as ``SequentialMLP`` names them (views: writes reach the stack)."""
            return {
                f"local_experts.{j}.{linear}.weight": getattr(self, name)[j]
                for name, linear in STACKED_EXPERTS.items()
                for j in range(self.num_local_experts)
            }

    return GroupedGemmExperts


# The per-expert linears' extra states (None) that a SequentialMLP checkpoint holds and GroupedGemmExperts has no
# tensor for.
_SEQUENTIAL_EXTRA_STATE = re.compile(rf"(^|\.)local_experts\.\d+\.({_LINEARS})\._extra_state$")


def _drop_sequential_extra_state(module: Any, incompatible: Any) -> None:
    # torch hands every post-hook the whole load's list: drop only the experts' own entries.
    unexpected = incompatible.unexpected_keys
    unexpected[:] = [k for k in unexpected if not _SEQUENTIAL_EXTRA_STATE.search(k)]


def grouped_mm(x: torch.Tensor, w: torch.Tensor, *, offs: torch.Tensor) -> torch.Tensor:
    """``x [N, K]`` rows grouped by ``offs`` (cumulative row counts, int32) times ``w [G, K, M]``: group ``g``'s rows
    by ``w[g]``; ``[N, M]``. ``torch._grouped_mm`` where its kernels take the operands (:func:`grouped_mm_takes`),
    else the same product one group at a time."""
    import torch

    if grouped_mm_takes(x, w):
        return torch._grouped_mm(x, w, offs=offs)
    out = x.new_empty(x.shape[0], w.shape[-1])
    start = 0
    for g, end in enumerate(offs.tolist()):
        out[start:end] = x[start:end] @ w[g]
        start = end
    return out


# Dtypes torch._grouped_mm computes, by device type (CUDA: bf16 on sm90's CUTLASS kernel; the CPU's reference kernel
# takes float32 too).
_GROUPED_MM_DTYPES = {"cuda": ("torch.bfloat16",), "cpu": ("torch.bfloat16", "torch.float32")}


def grouped_mm_takes(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` takes ``x`` and ``w``: a dtype of its kernels on their device, each operand
    row- or column-major in its last two dimensions with a 16-byte aligned leading stride and start."""
    import torch

    if not hasattr(torch, "_grouped_mm") or str(x.dtype) not in _GROUPED_MM_DTYPES.get(x.device.type, ()):
        return False
    return all(_aligned(t) for t in (x, w))


def _aligned(t: torch.Tensor) -> bool:
    size = t.element_size()
    if t.data_ptr() % 16:
        return False
    if t.stride(-1) == 1:
        return (t.stride(-2) * size) % 16 == 0
    return t.stride(-2) == 1 and (t.stride(-1) * size) % 16 == 0


def model_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A ``GPTModel``'s parameters and its routers' expert biases (buffers) by name: every tensor the weight mapping
    names."""
    out: dict[str, torch.Tensor] = dict(model.named_parameters())
    out.update((name, b) for name, b in model.named_buffers() if name.endswith(EXPERT_BIAS))
    for prefix, module in model.named_modules():
        if hasattr(module, "expert_views"):  # GroupedGemmExperts: each expert's slice of the stacks
            for name in STACKED_EXPERTS:
                del out[f"{prefix}.{name}"]
            out.update((f"{prefix}.{name}", view) for name, view in module.expert_views().items())
    return out


# ------------------------------------------------------------------ the balancing loss (--moe-aux-loss-coeff)


@dataclass(frozen=True)
class AuxLossKind:
    """One ``--moe-router-load-balancing-type`` this backend trains with a coefficient > 0: megatron-core's tracker
    name of its per-layer value, and whether a data-parallel rank's value is its share of one loss over the global
    batch (the ranks' values add up to it: ``global_aux_loss``, whose counts are summed over DP) rather than a loss of
    its own (the step's metric is then the mean over ranks)."""

    tracked: str
    shares_over_dp: bool = False


AUX_LOSS_KINDS = {
    "aux_loss": AuxLossKind("load_balancing_loss"),
    "seq_aux_loss": AuxLossKind("seq_load_balancing_loss"),
    # Each micro-batch's Switch loss against the tokens per expert averaged over the step's micro-batches so far
    # (summed over the data-parallel ranks), a running count megatron-core's finalize_model_grads resets after each
    # step; the CPU's own gradient path resets it too (reset_step_counts). Its coefficient is scaled by the DP size
    # (megatron_aux_loss_coeff), and every DP rank must run as many micro-batches (its counts are all-reduced over
    # the ranks in each router's forward).
    "global_aux_loss": AuxLossKind("global_load_balancing_loss", shares_over_dp=True),
}
AUX_LOSS_TRACKED = {kind: spec.tracked for kind, spec in AUX_LOSS_KINDS.items()}


def aux_loss_problems(train: Any) -> list[str]:
    """What is wrong with ``train``'s (a ``TrainConfig``) balancing-loss flags, one line each."""
    coeff, kind = train.moe_aux_loss_coeff, train.moe_router_load_balancing_type
    if coeff < 0:
        return [f"--moe-aux-loss-coeff must be >= 0, got {coeff}"]
    if coeff > 0 and kind not in (*AUX_LOSS_KINDS, "none"):
        built = ", ".join(AUX_LOSS_KINDS)
        return [f"--moe-router-load-balancing-type {kind} with --moe-aux-loss-coeff {coeff}: takes {built} or none"]
    return []


def megatron_aux_loss_coeff(kind: str, coeff: float, *, dp_size: int) -> float:
    """The coefficient megatron-core's routers are given for ``--moe-router-load-balancing-type kind`` and
    ``--moe-aux-loss-coeff coeff`` over ``dp_size`` data-parallel ranks: ``coeff``, times ``dp_size`` where a rank's
    loss is its share of one loss over the global batch (``global_aux_loss``). megatron-core 0.16.1 averages every
    gradient over the DP ranks, which is right for a loss of each rank's own (``aux_loss``: the mean of the ranks'
    losses) but leaves the global batch's loss, the sum of the shares, at ``1 / dp_size`` of its gradient
    (Megatron-LM#3672, open): scaled so, DP ranks train as one rank over the global batch. The routers record their
    losses without the coefficient, so the reported ``moe_aux_loss`` (:func:`recorded_aux_loss`, the flag's
    coefficient) is unchanged."""
    if dp_size < 1:
        raise ValueError(f"dp_size must be >= 1, got {dp_size}")
    spec = AUX_LOSS_KINDS.get(kind)
    return coeff * dp_size if spec is not None and spec.shares_over_dp else coeff


def aux_loss_metric_share(kind: str, value: float, *, dp_size: int) -> float:
    """This data-parallel rank's part of the step's ``moe_aux_loss`` metric (a sum over the DP ranks) from its
    recorded ``value`` (:func:`recorded_aux_loss`): the value itself where the ranks' values are shares of one loss,
    else ``value / dp_size`` (their mean)."""
    return value if AUX_LOSS_KINDS[kind].shares_over_dp else value / dp_size


def padding_mask(seq_lens: torch.Tensor, width: int) -> torch.Tensor:
    """``[b, width]`` bool, True at the padding after each row's ``seq_lens`` tokens: the ``padding_mask`` that
    megatron-core 0.16.1's ``GPTModel`` hands its routers. Its docstrings say True marks valid tokens, but its code
    (``compute_routing_scores_for_aux_loss``, ``_apply_expert_bias``, ``apply_z_loss``) keeps ``~padding_mask``:
    True marks padding (tests/test_megatron_moe_aux_loss.py holds it to the code), and the marked tokens stay out of
    the balancing loss and the expert-bias counts (they are still routed)."""
    import torch

    return torch.arange(width, device=seq_lens.device)[None, :] >= seq_lens[:, None]


def set_aux_loss_scale(scale: float, *, device: torch.device) -> None:
    """The factor on the balancing loss's gradient (megatron-core's ``MoEAuxLossAutoScaler``): ``1 / micro-batch
    count`` for a step over that many micro-batches, as megatron-core's pipeline schedules set it, so that the loss
    added is the mean of the micro-batches' (the data-parallel mean follows from the gradients' average).

    A new ``[1]`` tensor on ``device`` each time, as the schedules make theirs: megatron-core keeps one tensor per
    process and copies later scales into the first, so a scale left there by another model (a 0-d one, or one on
    another device) would break the schedules' copy or the backward's product."""
    import torch
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    MoEAuxLossAutoScaler.main_loss_backward_scale = None  # set_loss_scale then takes the new tensor as it is
    MoEAuxLossAutoScaler.set_loss_scale(torch.full((1,), scale, dtype=torch.float32, device=device))


def clear_aux_loss() -> None:
    """Drop megatron-core's per-layer record of the balancing losses (before a step's forwards). The record is one
    per process, sized by the first model that writes it; dropped rather than zeroed (megatron-core's
    ``clear_aux_losses_tracker``), the next forward sizes it by its own model's layer count."""
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    tracker = get_moe_layer_wise_logging_tracker()
    for name in AUX_LOSS_TRACKED.values():
        tracker.pop(name, None)


def recorded_aux_loss(
    coeff: float, *, micro_batches: int, groups: Sequence[Any], device: torch.device
) -> torch.Tensor:
    """The balancing loss the step's forwards added: ``coeff`` x the sum over MoE layers of the micro-batches' mean
    of each layer's loss, from megatron-core's per-layer record (:func:`clear_aux_loss` before the step); summed over
    ``groups`` (the tensor/context- and pipeline-parallel groups: each rank records its share of the tokens' sums
    and its own layers). A rank that recorded nothing (a pipeline stage of dense layers only, such as DeepSeek-V3's
    first) takes part in the sums with 0, on ``device``: every rank of a group must call each all-reduce."""
    import torch
    import torch.distributed as dist
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    tracker = get_moe_layer_wise_logging_tracker()
    values = [tracker[name]["values"] for name in AUX_LOSS_TRACKED.values() if name in tracker]
    total = torch.zeros((), dtype=torch.float64, device=device)
    if values:
        total = torch.stack([v.sum() for v in values]).sum().double().to(device)
    for group in groups:
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(total, group=group)
    return total * coeff / micro_batches


def reset_step_counts(model: torch.nn.Module) -> None:
    """Zero what megatron-core's routers count over one optimizer step (the tokens per expert of the expert-bias
    update, ``global_aux_loss``'s running counts): what its ``finalize_model_grads`` does after the gradients on
    GPUs, for the CPU's own gradient path."""
    import importlib

    fmg = importlib.import_module("megatron.core.distributed.finalize_model_grads")
    fmg.reset_model_temporary_tensors(model.config, [model])


def update_expert_bias(model: torch.nn.Module) -> None:
    """megatron-core's step of every router's expert bias by ``moe_router_bias_update_rate`` towards balanced loads
    (the tokens each expert got since the last step, summed over the tensor- and data-parallel ranks), then its
    counts reset: what its ``finalize_model_grads`` does after the gradients on GPUs, for the CPU's own gradient
    path."""
    import importlib

    # The module, not the function of the same name that megatron.core.distributed exports.
    fmg = importlib.import_module("megatron.core.distributed.finalize_model_grads")
    fmg._update_router_expert_bias([model], model.config)
    reset_step_counts(model)


__all__ = [
    "AUX_LOSS_KINDS",
    "AUX_LOSS_TRACKED",
    "AuxLossKind",
    "EXPERT_BIAS",
    "LOAD_BALANCING_BUILT",
    "MOE_READERS",
    "MoEShape",
    "STACKED_EXPERTS",
    "expert_to_hf",
    "grouped_gemm_experts",
    "grouped_mm",
    "grouped_mm_takes",
    "hf_moe_shapes",
    "is_expert",
    "layer_pattern",
    "local_experts",
    "mark_expert_grads",
    "megatron_aux_loss_coeff",
    "model_tensors",
    "moe_from_hf",
    "moe_to_megatron",
    "split_whole_experts",
    "aux_loss_metric_share",
    "aux_loss_problems",
    "clear_aux_loss",
    "padding_mask",
    "recorded_aux_loss",
    "reset_step_counts",
    "set_aux_loss_scale",
    "transformer_config_kwargs",
    "update_expert_bias",
]
