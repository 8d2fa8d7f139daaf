"""The torch backend's own options: the flags that only ``--train-backend torch`` reads (the Megatron backend has
its own optimizer, attention and model code, and no LoRA). The config refuses them under another backend
(``runtime.config``'s backend-fields check reads ``OWN_FIELDS``)."""

from __future__ import annotations

# Every flag this backend alone reads -> what it is (the refusal under another backend names it).
OWN_FIELDS: dict[str, str] = {
    "use_stateless_adam": "the torch backend's stateless AdamW (Megatron's optimizer keeps its moments)",
    "keep_old_actor": "a copy of the policy the torch backend keeps",
    "attn_implementation": "transformers' attention choice (the Megatron backend's is --attention-backend)",
    "torch_compile": "torch.compile of the transformers model",
    "lora_rank": "LoRA adapters (peft, on the transformers model)",
    "lora_alpha": "a LoRA setting",
    "lora_dropout": "a LoRA setting",
    "lora_target_modules": "a LoRA setting",
    "lora_modules_to_save": "a LoRA setting",
    "lora_export": "a LoRA setting",
}
