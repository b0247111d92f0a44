"""Builds a tiny random-init Llama model + byte-level BPE tokenizer locally (no hub) for real-vLLM tests.

Run with the vLLM venv's python (it needs torch, transformers, tokenizers):

    .venv-vllm/bin/python scripts/build_tiny_model.py --size tiny --out .cache/tiny-llama
    .venv-vllm/bin/python scripts/build_tiny_model.py --size bench --out .cache/bench-llama

Deterministic: the tokenizer is trained on a sorted, fixed list of stdlib files and the weights come from a
fixed seed. `initializer_range` is large (0.3) so that the logits are far from uniform: a wrong KV cache then
changes greedy outputs, which is what the correctness tests rely on.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import sysconfig
from pathlib import Path

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>"]

# ChatML, plus what agent turns carry (Qwen-style): tools in the system turn, reasoning in <think>, tool calls
# in <tool_call>, tool results as their own turn. Content may be a string or a list of text parts (the loop over
# it makes vLLM pass parts as objects, its "openai" content format). A plain string conversation renders as
# before: '<|im_start|>' + role + '\n' + content + '<|im_end|>\n' per message.
CHAT_TEMPLATE = (
    "{%- macro render_content(content) -%}"
    "{%- if content is string -%}{{- content -}}"
    "{%- elif content is iterable -%}"
    "{%- for part in content -%}{%- if part.type == 'text' -%}{{- part.text -}}{%- endif -%}{%- endfor -%}"
    "{%- endif -%}"
    "{%- endmacro -%}"
    "{%- if tools -%}"
    "{{- '<|im_start|>system\n' -}}"
    "{%- if messages and messages[0].role == 'system' -%}{{- render_content(messages[0].content) + '\n\n' -}}"
    "{%- endif -%}"
    "{{- '# Tools\n<tools>' -}}"
    "{%- for tool in tools -%}{{- '\n' + (tool | tojson) -}}{%- endfor -%}"
    "{{- '\n</tools><|im_end|>\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if not (tools and loop.first and message.role == 'system') -%}"
    "{{- '<|im_start|>' + message.role + '\n' -}}"
    "{%- if message.role == 'assistant' and message.reasoning_content -%}"
    "{{- '<think>\n' + message.reasoning_content + '\n</think>\n\n' -}}"
    "{%- endif -%}"
    "{{- render_content(message.content) -}}"
    "{%- if message.role == 'assistant' and message.tool_calls -%}"
    "{%- for call in message.tool_calls -%}"
    "{{- '\n<tool_call>\n{\"name\": \"' + call.function.name + '\", \"arguments\": '"
    " + (call.function.arguments | tojson) + '}\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"
)

SIZES: dict[str, dict[str, int]] = {
    # Correctness tests: fast start-up, tiny KV.
    "tiny": {"layers": 2, "hidden": 128, "heads": 4, "kv_heads": 2, "intermediate": 256, "max_pos": 4096},
    # Timing benchmarks: large enough that prefill compute dominates on CPU.
    "bench": {"layers": 8, "hidden": 1024, "heads": 16, "kv_heads": 4, "intermediate": 2816, "max_pos": 16384},
}


def corpus_files(limit_bytes: int = 8_000_000) -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files: list[str] = []
    total = 0
    for p in sorted(stdlib.glob("*.py")):
        size = p.stat().st_size
        if total + size > limit_bytes:
            break
        files.append(str(p))
        total += size
    if not files:
        raise SystemExit(f"no .py files found under {stdlib}")
    return files


def build_tokenizer(out: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train(corpus_files(), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        unk_token=None,
        pad_token="<pad>",
        additional_special_tokens=["<|endoftext|>", "<|im_start|>"],
        model_max_length=1_000_000,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))


def build_model(out: Path, size: str, seed: int) -> None:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    spec = SIZES[size]
    tok = AutoTokenizer.from_pretrained(str(out))
    vocab = len(tok)
    eos_id = tok.convert_tokens_to_ids("<|im_end|>")
    pad_id = tok.convert_tokens_to_ids("<pad>")
    bos_id = tok.convert_tokens_to_ids("<|endoftext|>")
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=spec["hidden"],
        intermediate_size=spec["intermediate"],
        num_hidden_layers=spec["layers"],
        num_attention_heads=spec["heads"],
        num_key_value_heads=spec["kv_heads"],
        max_position_embeddings=spec["max_pos"],
        initializer_range=0.3,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    model = model.to(torch.bfloat16)
    model.generation_config.eos_token_id = eos_id
    model.generation_config.pad_token_id = pad_id
    model.generation_config.bos_token_id = bos_id
    model.generation_config.do_sample = False
    model.save_pretrained(str(out), safe_serialization=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    out: Path = args.out or Path(".cache") / f"{args.size}-llama"
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out, args.vocab_size)
    build_model(out, args.size, args.seed)
    info = {"size": args.size, "seed": args.seed, "vocab_size": args.vocab_size, **SIZES[args.size]}
    (out / "kvtether-model.json").write_text(json.dumps(info, indent=2) + "\n")
    print(str(out.resolve()), file=sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
