import sys, time, statistics, json
import torch
from longctx import LLM, SamplingParams
torch.set_num_threads(2)
llm = LLM("smollm2-135m", dtype="float32", enable_prefix_caching=False, lookahead=False)
tok = llm.get_tokenizer()
text = open("/work/main/examples/data/gpl-3.txt").read()
ids = tok.encode(text * 3)[:4096]
llm.generate({"prompt_token_ids": ids[:256]}, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
out = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0.0, max_tokens=257, ignore_eos=True))[0]
lat = out.metrics.inter_token_latencies
batch = []
for _ in range(2):
    t0 = time.perf_counter()
    llm.generate([{"prompt_token_ids": ids[i * 1024:(i + 1) * 1024]} for i in range(4)],
                 SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    batch.append(64 / (time.perf_counter() - t0))
print(json.dumps({"rev": sys.argv[1], "decode_ms": 1000 * statistics.median(lat), "batch_tok_s": max(batch),
                  "tokens": out.outputs[0].token_ids[:8]}))
