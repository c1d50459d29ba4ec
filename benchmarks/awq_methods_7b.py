"""Wall time of `lmd awq`'s methods on a 7B Llama shape (issue 16's goal: <= 8 minutes on one H200).

The weights are random (the time does not depend on their values) and the calibration ids random, 128 x 512 as
`lmd awq`'s defaults; the model stays in host memory in fp32 and each decoder layer visits --device in turn, exactly
as `lmd awq` runs (`quantize_model`). Prints one JSON line per method.

    python benchmarks/awq_methods_7b.py --device cuda --methods awq,awq-gptq,autoround
    python benchmarks/awq_methods_7b.py --device cpu --layers 1 --hidden 512 --intermediate 1024   # a smoke run
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from lmd.lite.awq import AwqConfig, quantize_model
from lmd.lite.awq_methods import method_fields


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--methods", default="awq,awq-gptq,autoround")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--intermediate", type=int, default=11008)
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--samples", type=int, default=128)
    parser.add_argument("--seqlen", type=int, default=512)
    args = parser.parse_args()
    config = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                         num_attention_heads=args.hidden // 128, num_key_value_heads=args.hidden // 128,
                         vocab_size=32000, max_position_embeddings=4096)
    ids = torch.randint(0, 32000, (args.samples, args.seqlen), generator=torch.Generator().manual_seed(0))
    for method in args.methods.split(","):
        start = time.perf_counter()
        torch.manual_seed(0)
        model = LlamaForCausalLM(config).eval()
        built = time.perf_counter() - start
        f = method_fields(method)
        awq = AwqConfig(group_size=args.group_size, search_scale=f.search_scale, clip=f.clip, gptq=f.gptq,
                        sign_round=f.sign_round, device=args.device)
        start = time.perf_counter()
        with torch.no_grad():
            quantize_model(model, ids, awq)
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        print(json.dumps({"method": method, "layers": args.layers, "hidden": args.hidden, "device": args.device,
                          "group_size": args.group_size, "build_s": round(built, 1),
                          "quantize_s": round(time.perf_counter() - start, 1)}), flush=True)
        del model


if __name__ == "__main__":
    main()
