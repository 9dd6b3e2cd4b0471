"""A Gemma-3-4B-shaped vision-language model with random weights, for timing image prefill
(`ferrum bench --image`) against llama.cpp's `llama-mtmd-cli` on the same files.

    /work/pyt/bin/python scripts/make_gemma3_vlm_bench.py LLAMA_CPP_DIR OUT_DIR [TEXT_LAYERS]

The vision tower is Gemma 3 4B's in full (SigLIP-so400m: 27 layers, 1152 wide, 4304 in the MLP,
16 heads; 896-pixel images in 14-pixel patches, 4096 of them, pooled to 256 image tokens). The
language model has 4B's width (2560, 8 heads of 256 with 4 KV heads, 10240 in the MLP) and
TEXT_LAYERS layers (default 6, in Gemma 3's pattern of five local and one global), with the
small tokenizer of tests/fixtures/vision/gemma3_it: the image's 258 prompt rows are what the
language model's share of the timing covers, and its vocabulary does not enter that.

Writes OUT_DIR/hf (the checkpoint, bf16 as Google ships it) and OUT_DIR/model-f16.gguf with
OUT_DIR/mmproj-model-f16.gguf (llama.cpp's converter, f16: the files people download).
"""

import json
import os
import shutil
import subprocess
import sys

import torch
from safetensors.torch import load_file, save_file
from transformers import Gemma3Config, Gemma3ForConditionalGeneration

HERE = os.path.dirname(os.path.abspath(__file__))
TOK = os.path.join(HERE, "..", "tests", "fixtures", "vision", "gemma3_it")
LLAMA, OUT = sys.argv[1], sys.argv[2]
LAYERS = int(sys.argv[3]) if len(sys.argv) > 3 else 6
HF = os.path.join(OUT, "hf")
os.makedirs(HF, exist_ok=True)

tiny = json.load(open(os.path.join(TOK, "config.json")))
for f in ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja"]:
    shutil.copy(os.path.join(TOK, f), os.path.join(HF, f))
vocab = tiny["text_config"]["vocab_size"]
pattern = ["sliding_attention"] * 5 + ["full_attention"]
torch.manual_seed(0)
cfg = Gemma3Config(
    text_config=dict(
        vocab_size=vocab, hidden_size=2560, intermediate_size=10240, num_hidden_layers=LAYERS,
        num_attention_heads=8, num_key_value_heads=4, head_dim=256, query_pre_attn_scalar=256,
        sliding_window=1024, layer_types=[pattern[i % 6] for i in range(LAYERS)],
        max_position_embeddings=8192, rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}},
        rms_norm_eps=1e-6, pad_token_id=0, bos_token_id=2,
        eos_token_id=tiny["text_config"]["eos_token_id"],
    ),
    vision_config=dict(
        hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16,
        image_size=896, patch_size=14, layer_norm_eps=1e-6, hidden_act="gelu_pytorch_tanh",
        vision_use_head=False,
    ),
    mm_tokens_per_image=256, boi_token_index=tiny["boi_token_index"],
    eoi_token_index=tiny["eoi_token_index"], image_token_index=tiny["image_token_index"],
    tie_word_embeddings=True,
)
model = Gemma3ForConditionalGeneration(cfg).to(torch.bfloat16).eval()
model.save_pretrained(HF, safe_serialization=True, max_shard_size="20GB")
del model
# transformers 5 saves the tower as `vision_tower.*`; llama.cpp's converter reads
# transformers 4's `vision_tower.vision_model.*`: the same weights under those names.
path = os.path.join(HF, "model.safetensors")
state = {}
for k, v in load_file(path).items():
    if k.startswith("vision_tower.") and not k.startswith("vision_tower.vision_model."):
        k = "vision_tower.vision_model." + k[len("vision_tower."):]
    state[k] = v
save_file(state, path, metadata={"format": "pt"})
del state
json.dump({
    "image_processor_type": "Gemma3ImageProcessor", "processor_class": "Gemma3Processor",
    "size": {"height": 896, "width": 896}, "resample": 2, "do_rescale": True,
    "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5], "do_convert_rgb": True, "do_pan_and_scan": False,
    "image_seq_length": 256,
}, open(os.path.join(HF, "preprocessor_config.json"), "w"), indent=1)
json.dump({"processor_class": "Gemma3Processor", "image_seq_length": 256},
          open(os.path.join(HF, "processor_config.json"), "w"), indent=1)

RUN = f"""
import sys
sys.path.insert(0, {LLAMA!r})
sys.argv = sys.argv[1:]
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
sys.argv[0] = {os.path.join(LLAMA, "convert_hf_to_gguf.py")!r}
exec(compile(open(sys.argv[0]).read(), sys.argv[0], "exec"), {{"__file__": sys.argv[0], "__name__": "__main__"}})
"""
for extra, name in [([], "model-f16.gguf"), (["--mmproj"], "mmproj-model-f16.gguf")]:
    subprocess.run([sys.executable, "-c", RUN, "convert", HF, *extra, "--outtype", "f16",
                    "--outfile", os.path.join(OUT, name)], check=True)
