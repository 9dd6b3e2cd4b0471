"""A Mistral-Small-3.1-shaped vision-language model with random weights, for timing image prefill
(`ferrum bench --image`) against llama.cpp's `llama-mtmd-cli` on the same files.

    /work/pyt/bin/python scripts/make_mistral3_vlm_bench.py LLAMA_CPP_DIR OUT_DIR [TEXT_LAYERS]

The vision tower is Mistral Small 3.1's in full (Pixtral: 24 layers, 1024 wide, 4096 in the SwiGLU
MLP, 16 heads of 64; 14-pixel patches, so an 896-pixel square image is 4096 patches, merged 2x2 to
1024 image tokens plus 32 row breaks), with its projector (RMSNorm, the 2x2 merge, a GELU MLP to
5120). The language model has Mistral Small 3.1's width (5120, 32 heads of 128 with 8 KV heads,
32768 in the MLP) and TEXT_LAYERS layers (default 2), with the small tokenizer of
tests/fixtures/vision/mistral3_it: the image's prompt rows are what the language model's share of
the timing covers, and its vocabulary does not enter that.

Writes OUT_DIR/hf (the checkpoint, bf16 as Mistral ships it) and OUT_DIR/model-f16.gguf with
OUT_DIR/mmproj-model-f16.gguf (llama.cpp's converter, f16, with the same change as
scripts/fixtures/make_qwen_vl_gguf.py's for Mistral 3: the `[IMG_BREAK]` row reaches the mmproj).
"""

import json
import os
import shutil
import sys

import torch
from transformers import Mistral3Config, Mistral3ForConditionalGeneration

HERE = os.path.dirname(os.path.abspath(__file__))
TOK = os.path.join(HERE, "..", "tests", "fixtures", "vision", "mistral3_it")
LLAMA, OUT = sys.argv[1], sys.argv[2]
LAYERS = int(sys.argv[3]) if len(sys.argv) > 3 else 2
HF = os.path.join(OUT, "hf")
os.makedirs(HF, exist_ok=True)

tiny = json.load(open(os.path.join(TOK, "config.json")))
for f in ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "preprocessor_config.json"]:
    shutil.copy(os.path.join(TOK, f), os.path.join(HF, f))
torch.manual_seed(0)
t = tiny["text_config"]
cfg = Mistral3Config(
    text_config=dict(
        model_type="mistral", vocab_size=t["vocab_size"], hidden_size=5120, intermediate_size=32768,
        num_hidden_layers=LAYERS, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=131072, rope_theta=1_000_000_000.0, rms_norm_eps=1e-5,
        sliding_window=None, tie_word_embeddings=False, bos_token_id=t["bos_token_id"],
        eos_token_id=t["eos_token_id"],
    ),
    vision_config=dict(
        model_type="pixtral", hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
        num_attention_heads=16, head_dim=64, patch_size=14, image_size=1540, hidden_act="silu",
        rope_theta=10_000.0,
    ),
    image_token_index=tiny["image_token_index"], spatial_merge_size=2, projector_hidden_act="gelu",
    multimodal_projector_bias=False, vision_feature_layer=-1, tie_word_embeddings=False,
)
with torch.device("cpu"):
    torch.set_default_dtype(torch.bfloat16)
    model = Mistral3ForConditionalGeneration(cfg).eval()
model.save_pretrained(HF, safe_serialization=True, max_shard_size="20GB")
del model
pre = json.load(open(os.path.join(HF, "preprocessor_config.json")))
pre.update({"patch_size": {"height": 14, "width": 14}, "size": {"longest_edge": 1540}})
json.dump(pre, open(os.path.join(HF, "preprocessor_config.json"), "w"), indent=1)
json.dump({"processor_class": "PixtralProcessor", "patch_size": 14, "spatial_merge_size": 2,
           "image_token": "[IMG]", "image_break_token": "[IMG_BREAK]", "image_end_token": "[IMG_END]"},
          open(os.path.join(HF, "processor_config.json"), "w"), indent=1)

sys.path.insert(0, os.path.join(HERE, "fixtures"))
from make_qwen_vl_gguf import convert  # noqa: E402

convert(LLAMA, HF, OUT, "f16", keep_img_break=True)
