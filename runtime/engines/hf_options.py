"""The embedded engine's own options (``--rollout-engine hf``: transformers in one process). ``runtime.config``
composes :class:`HFEngineOptions` into its ``rollout`` section (``cfg.rollout.engine_compile``) and refuses these
flags under another engine (from :data:`OWN_FIELDS`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from runtime.option_fields import bounded, described, own_fields


@dataclass(frozen=True)
class HFEngineOptions:
    """The embedded engine's flags."""

    OWN = "a flag of the embedded engine (SGLang servers take --sglang-* flags)"

    engine_compile: bool = field(
        default=False,
        metadata=described(
            "ours: the embedded engine (--rollout-engine hf) on a GPU runs its decode step through torch.compile "
            "before capturing it as a CUDA graph: faster decoding (Qwen3-0.6B, 64x512 on an H100: 2.3 s instead of "
            "3.9 s) for a compile of about a minute per batch size and 128-token cache-length bucket"
        ),
    )
    engine_max_running_requests: int | None = field(
        default=None,
        metadata=bounded(
            gt=0,
            help="ours: the embedded engine (--rollout-engine hf) decodes at most N prompts at once over a KV cache "
            "of N rows; a row that stops is refilled with a waiting prompt (continuous refill). Default: all prompts "
            "of a call at once. Each prompt draws from its own seeded stream, whatever N (docs/runtime.md, Engines)",
        ),
    )
    engine_kv_cache_tokens: int | None = field(
        default=None,
        metadata=bounded(
            gt=0,
            help="ours: the embedded engine's paged KV cache holds at most N tokens (pages of 64 on a GPU): a group "
            "starts when its prompt's pages and a first page per sample are free, rows take pages as they grow, and "
            "when they run short the group started last is preempted and starts over (its seeded streams redraw the "
            "same tokens). Default: room for every running row's longest response (docs/runtime.md, Engines)",
        ),
    )


# Each section of the config this engine adds fields to.
OPTIONS: dict[str, type] = {"rollout": HFEngineOptions}
# Every flag this engine alone reads -> what it is (the refusal under another engine names it).
OWN_FIELDS: dict[str, str] = own_fields(HFEngineOptions)
# Top-p replay (--rollout-top-p below 1): this engine reports each token's nucleus (``Generation.extra``'s
# ``top_p_token_ids`` / ``top_p_token_offsets``, slime's layout), the half of the replay an engine owes.
REPORTS_TOP_P_NUCLEI = True
