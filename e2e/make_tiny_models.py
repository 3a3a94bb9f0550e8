#!/usr/bin/env python3
"""Write tiny seeded random-weight models (and one local tokenizer) for the offline e2e runs.

Weights come from transformers `from_config` under a fixed seed and are saved with
`save_pretrained` (not vLLM's load_format=dummy, whose greedy output is a constant token).
The tokenizer is a byte-level BPE trained here, with `tokenizers`, on text of the local task.

    python e2e/make_tiny_models.py [--out DIR] [--only NAME ...]

Models (name: what it exercises):
  gemma3    Gemma-3 style: 3 sliding (window 32) + 1 full attention layer -> several KV cache groups
  gemma4    Gemma-4 style: sliding head_dim 32, full global_head_dim 64 -> groups with different
            block sizes. transformers 5.24 stores the full-layer head size as `per_layer_config`
            (then config.head_dim raises) and drops `global_head_dim`, which vLLM 0.22.1 reads;
            the config is saved without per-layer entries and the runner passes
            global_head_dim with --hf-overrides (see MODELS[...]["serve_args"]).
  gptoss    GPT-OSS style: sliding + full attention with sinks, MoE (model_type renamed at serve
            time: see MODELS["gptoss"])
  llama     plain Llama: a single KV cache group (control)
"""

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_task import corpus_text  # noqa: E402

DEFAULT_OUT = Path(os.environ.get("E2E_MODELS_DIR",
                                  Path(__file__).resolve().parents[1] / "build" / "tiny-models"))
VOCAB = 512
SEED = 0

# Extra `vllm serve` arguments a model needs; hma: has several KV cache groups.
MODELS: dict[str, dict] = {
    "gemma3": {"hma": True, "serve_args": []},
    "gemma4": {"hma": True, "serve_args": ["--hf-overrides", json.dumps({"global_head_dim": 64})]},
    # model_type only selects the harmony chat/responses front-end in vLLM's server, which loads
    # the o200k vocab from the internet at start-up (HarmonyError offline); completions and the
    # model itself (unquantized) do not read it. Rename it so the server starts offline.
    "gptoss": {"hma": True,
               "serve_args": ["--hf-overrides", json.dumps({"model_type": "gpt_oss_offline"})]},
    "llama": {"hma": False, "serve_args": []},
}


def make_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<pad>", "<eos>", "<bos>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus_text(), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                   bos_token="<bos>", unk_token="<unk>", model_max_length=4096)


def make_config(name: str):
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=2,
                  num_key_value_heads=1, max_position_embeddings=4096, pad_token_id=0,
                  eos_token_id=1, bos_token_id=2, tie_word_embeddings=True)
    if name == "gemma3":
        c = tf.Gemma3TextConfig(**common, num_hidden_layers=4, head_dim=32, sliding_window=32,
                                layer_types=["sliding_attention"] * 3 + ["full_attention"])
        c.architectures = ["Gemma3ForCausalLM"]
    elif name == "gemma4":
        c = tf.Gemma4TextConfig(**common, num_hidden_layers=4, head_dim=32, global_head_dim=64,
                                sliding_window=32, hidden_size_per_layer_input=0,
                                vocab_size_per_layer_input=VOCAB,
                                layer_types=["sliding_attention"] * 3 + ["full_attention"])
        c.architectures = ["Gemma4ForCausalLM"]
    elif name == "gptoss":
        c = tf.GptOssConfig(**{**common, "tie_word_embeddings": False}, num_hidden_layers=4,
                            head_dim=32, sliding_window=32, num_local_experts=4,
                            num_experts_per_tok=2,  # default yarn rope: vLLM reads its factor
                            layer_types=["sliding_attention", "full_attention"] * 2)
        c.architectures = ["GptOssForCausalLM"]
    elif name == "llama":
        c = tf.LlamaConfig(**common, num_hidden_layers=4, head_dim=32)
        c.architectures = ["LlamaForCausalLM"]
    else:
        raise SystemExit(f"unknown model {name!r}; choose from {', '.join(MODELS)}")
    c.dtype = "bfloat16"
    return c


def make_model(name: str, out: Path, tokenizer) -> Path:
    import torch
    from transformers import AutoModelForCausalLM

    cfg = make_config(name)
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    # from_config's init is small (std 0.02): scale the weights up so greedy output varies
    with torch.no_grad():
        g = torch.Generator().manual_seed(SEED)
        for p in model.parameters():
            if p.ndim >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * (1.0 / p.shape[-1] ** 0.5))
    path = out / name
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    if name == "gemma4":
        # transformers 5.24 turns global_head_dim into per_layer_config (full layers: head_dim
        # 64), and then raises AmbiguousGlobalPerLayerAttributeError when vLLM 0.22.1 reads
        # config.head_dim. Save the weights made that way, but a config without per-layer
        # entries; vLLM gets global_head_dim back through --hf-overrides (MODELS["gemma4"]).
        cj = json.loads((path / "config.json").read_text())
        cj["per_layer_config"] = {}
        cj["global_head_dim"] = 64
        (path / "config.json").write_text(json.dumps(cj, indent=2))
    n_params = sum(p.numel() for p in model.parameters())
    print(f"  {name:7s} {cfg.architectures[0]:20s} {n_params/1e3:.0f}k params -> {path}")
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--only", nargs="*", default=list(MODELS), choices=list(MODELS))
    a = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    a.out.mkdir(parents=True, exist_ok=True)
    print(f"writing tiny models to {a.out} (seed {SEED}, vocab {VOCAB})")
    tok = make_tokenizer()
    tok.save_pretrained(a.out / "tokenizer")
    for name in a.only:
        make_model(name, a.out, tok)


if __name__ == "__main__":
    main()
