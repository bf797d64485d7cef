"""Seed incident 4: a bf16 CLIP text encoder whose text_projection stayed fp16.

Plain torch: `expected m1 and m2 to have the same dtype`. Adding `import torchfix`
makes it run (the stray weight is cast to bf16 for each call) and reports it.
"""

import torch
from transformers import CLIPTextConfig, CLIPTextModelWithProjection

torch.manual_seed(0)
config = CLIPTextConfig(
    vocab_size=1000, hidden_size=32, intermediate_size=37, num_hidden_layers=2,
    num_attention_heads=4, projection_dim=16, max_position_embeddings=77,
    pad_token_id=1, bos_token_id=0, eos_token_id=2,
)  # fmt: skip
model = CLIPTextModelWithProjection(config).to(torch.bfloat16).eval()
model.text_projection.to(torch.float16)  # what a partial .to() / bad checkpoint leaves behind
ids = torch.randint(1, 999, (2, 12))

try:
    with torch.no_grad():
        model(input_ids=ids)
except RuntimeError as exc:
    print(f"plain torch: RuntimeError: {exc}")

import torchfix  # noqa: E402  (the one line a user adds; TORCHFIX_MODE=fix by default)

with torch.no_grad():
    out = model(input_ids=ids)
print(f"with torchfix: text_embeds {tuple(out.text_embeds.shape)} {out.text_embeds.dtype}")
print(torchfix.report().summary())
assert out.text_embeds.dtype == torch.bfloat16
assert [e.module for e in torchfix.report().events] == ["text_projection"]
