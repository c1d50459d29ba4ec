"""Issue 15's "Must show" on the real model: SmolLM2-135M-Instruct on CPU, through the official `openai` client.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/openai_api_smollm2.py            # builds the model dirs if missing
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/openai_api_smollm2.py --workspace /tmp/smollm2-qwen-ws --json

A CPU script, not a test (the tests run the same paths on a tiny random model). The model: the shared GGUF
(`../shared/models/SmolLM2-135M-Instruct.Q4_1.gguf`) dequantized once to an fp32 HF directory (`--hf-dir`, what the
tests' `smollm2_hf` fixture makes; also the reference for the logprob check), then deployed as an fp32 workspace with
the `qwen` template (`--workspace`): SmolLM2's own ChatML template has no tool format, Qwen2.5's is ChatML with tools
and the `hermes` parser (docs/serve.md, Tool calling). Both are reused when present.

The app (`lmd.serve.app.create_app`) runs in-process behind `fastapi.testclient.TestClient`, the engine on CPU, and
`openai.OpenAI(base_url="http://testserver/v1", http_client=<the TestClient>)` talks to it. Checks:
- n=3 on /v1/completions: three different samples, and engine.stats().computed_tokens grew by prompt + 3 x (max_tokens
  - 1) (one prefill; each sample's first token comes from the prefill's logits); best_of=4, n=1 returns the sample of
  n=4 (same seed: sample i draws from seed + i) with the highest cumulative logprob.
- json_schema response_format: 20 extraction prompts and schemas, each streamed and not (20 at once in a thread
  pool, so the engine batches them); every reply must json.loads and jsonschema.validate.
- tool calling: tool_choice "required" and "auto" for get_weather(city), the follow-up with the tool message, and the
  streamed variant (tool-call deltas assembled as the client yields them).
- echo=True, logprobs=1: the prompt's token logprobs against HF transformers' fp32 log-softmax (<= 1e-4 absolute).

A rich table at the end; `--json` prints the whole record instead. Exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
GGUF = REPO.parent / "shared" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL = "smollm2"
ENGINE_OPTIONS = dict(device="cpu", session_len=2048, max_batch_size=32, cache_block_seq_len=16,
                      cache_max_entry_count=640, max_context_token_num=2048)
LOGPROB_TOL = 1e-4


def text(n: int) -> dict:
    return {"type": "string", "maxLength": n}


def integer(lo: int, hi: int) -> dict:
    return {"type": "integer", "minimum": lo, "maximum": hi}


def obj(**props: dict) -> dict:
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


HHMM = {"type": "string", "pattern": "^[0-2][0-9]:[0-5][0-9]$"}
CASES: list[tuple[str, str, dict]] = [
    ("person", "Extract the person as JSON: 'Maria Lopez is a 34-year-old nurse who lives in Madrid.'",
     obj(name=text(40), age=integer(0, 120), occupation=text(30), city=text(30))),
    ("product", "Extract the product as JSON: 'The Acme X200 wireless headphones cost 59 dollars and are in stock.'",
     obj(name=text(40), price_usd=integer(0, 10000), in_stock={"type": "boolean"})),
    ("address", "Extract the address as JSON: 'Please ship it to 221B Baker Street, London NW1 6XE, United Kingdom.'",
     obj(street=text(40), city=text(30), postcode={"type": "string", "pattern": "^[A-Z0-9 ]{3,10}$"},
         country=text(30))),
    ("shopping list", "Turn this into JSON: 'Shopping list: two apples, one loaf of bread and three bottles of milk.'",
     obj(items={"type": "array", "items": obj(name=text(20), quantity=integer(1, 20)), "minItems": 1,
                "maxItems": 5})),
    ("sentiment enum", "Classify the sentiment of this review: 'The battery died after one day. Very disappointed.'",
     obj(sentiment={"enum": ["positive", "negative", "neutral"]})),
    ("nested employee", "Extract as JSON: 'John Smith is an engineer at Globex; his email is john.smith@globex.com.'",
     obj(employee=obj(name=text(40), email={"type": "string", "pattern": "^[a-z.]{1,30}@[a-z]{1,20}\\.[a-z]{2,4}$"}),
         company=obj(name=text(30), role=text(30)))),
    ("event", "Extract the event as JSON: 'The team meeting is on 2026-03-14 at 10:00 in room B2.'",
     obj(title=text(40), date={"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}, time=HHMM,
         room=text(10))),
    ("book", "Extract the book as JSON: 'Dune, the novel by Frank Herbert, was published in 1965.'",
     obj(title=text(40), author=text(40), year=integer(1000, 2100))),
    ("weather", "Extract the weather report as JSON: 'Paris today: 18 degrees Celsius and sunny.'",
     obj(city=text(30), temperature_c=integer(-50, 60), condition={"enum": ["sunny", "cloudy", "rainy", "snowy"]})),
    ("planets (top-level array)", "List the three planets closest to the Sun as a JSON array of names.",
     {"type": "array", "items": text(12), "minItems": 3, "maxItems": 3}),
    ("spam boolean", "Is this email spam? 'Congratulations, you won a free cruise! Click here now.' Answer in JSON.",
     obj(is_spam={"type": "boolean"}, reason=text(60))),
    ("rating range", "Rate the movie Inception from 1 to 10 and answer in JSON.",
     obj(movie=text(40), rating=integer(1, 10))),
    ("order enum+int", "Extract the order as JSON: 'Order 4512: three t-shirts in size M, shipped to Berlin.'",
     obj(order_id=integer(0, 999999), quantity=integer(1, 100), size={"enum": ["S", "M", "L", "XL"]},
         city=text(30))),
    ("contact pattern", "Extract the contact as JSON: 'You can call Dr. Chen at 555-0142.'",
     obj(name=text(40), phone={"type": "string", "pattern": "^[0-9]{3}-[0-9]{4}$"})),
    ("recipe", "Describe the recipe as JSON: 'Pancakes need flour, eggs, milk and sugar, and take 20 minutes.'",
     obj(dish=text(30), ingredients={"type": "array", "items": text(20), "minItems": 2, "maxItems": 6},
         minutes=integer(1, 600))),
    ("language", "Which language is this sentence in: 'Bonjour, comment allez-vous ?' Answer in JSON.",
     obj(language={"enum": ["English", "French", "Spanish", "German"]}, confidence_percent=integer(0, 100))),
    ("flight", "Extract the flight as JSON: 'Flight AF1234 from Paris to New York departs at 14:30.'",
     obj(flight={"type": "string", "pattern": "^[A-Z]{2}[0-9]{3,4}$"}, origin=text(30), destination=text(30),
         departure=HHMM)),
    ("company offices", "Extract as JSON: 'Initech has offices in Austin and Dallas and employs 250 people.'",
     obj(company=text(30), offices={"type": "array", "items": obj(city=text(30)), "minItems": 1, "maxItems": 4},
         employees=integer(1, 1000000))),
    ("yes/no + optional note", "Is the Pacific the largest ocean on Earth? Answer in JSON.",
     {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "note": {"type": ["string", "null"],
                                                                                  "maxLength": 60}},
      "required": ["answer", "note"]}),
    ("invoice", "Extract the invoice as JSON: 'Invoice INV-117: 2 hours of consulting at 90 EUR per hour, paid.'",
     obj(invoice_number={"type": "string", "pattern": "^[A-Z]{3}-[0-9]{1,6}$"},
         line_items={"type": "array", "items": obj(description=text(30), hours=integer(0, 100),
                                                   rate_eur=integer(0, 10000)), "minItems": 1, "maxItems": 3},
         paid={"type": "boolean"})),
]
SCHEMA_MAX_TOKENS = 160

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "the city name"}},
                   "required": ["city"]}}}]
WEATHER_Q = [{"role": "user", "content": "What is the weather like in Paris right now?"}]
TOOL_RESULT = "18 C, sunny"

SAMPLE_PROMPT = "Once upon a time, in a small village by the sea, there lived"
ECHO_PROMPT = ("The quick brown fox jumps over the lazy dog. Paris is the capital of France, and Berlin is the "
               "capital of Germany. Water boils at 100 degrees Celsius at sea level.")
ECHO_BATCH = ["Question: What is the largest planet in the Solar System?\nAnswer: Jupiter",
              "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"]


# ---------------------------------------------------------------------------------------------------- the model

def ensure_model(hf_dir: Path, workspace: Path | None) -> tuple[Path, Path]:
    """(fp32 HF dir, qwen-template fp32 workspace), made from the shared GGUF when missing."""
    if not (hf_dir / "model.safetensors").is_file():
        from lmd.model_source import load_causal_lm, load_tokenizer, resolve_model

        print(f"dequantizing {GGUF.name} to {hf_dir} (fp32) ...", file=sys.stderr)
        source = resolve_model(GGUF)
        load_causal_lm(source).save_pretrained(hf_dir)
        load_tokenizer(source).save_pretrained(hf_dir)
    ws = workspace or Path("/tmp/smollm2-qwen-ws")
    if not (ws / "triton_models" / "weights" / "config.ini").is_file():
        from lmd.deploy.converter import deploy

        print(f"deploying {hf_dir} as `qwen` (fp32) to {ws} ...", file=sys.stderr)
        deploy("qwen", str(hf_dir), str(ws), dtype="float32", progress=False)
    return hf_dir, ws


# ---------------------------------------------------------------------------------------------------- checks

def check_sampling(client: Any, engine: Any) -> dict:
    max_tokens, seed = 12, 7
    common = dict(model=MODEL, prompt=SAMPLE_PROMPT, max_tokens=max_tokens, temperature=0.8, seed=seed,
                  extra_body={"ignore_eos": True})
    before = engine.stats()
    reply = client.completions.create(n=3, **common)
    after = engine.stats()
    texts = [c.text for c in reply.choices]
    prompt_tokens = reply.usage.prompt_tokens
    computed = after.computed_tokens - before.computed_tokens
    expected = prompt_tokens + 3 * (max_tokens - 1)
    n3 = dict(texts=texts, distinct=len(set(texts)), prompt_tokens=prompt_tokens,
              completion_tokens=reply.usage.completion_tokens, computed_tokens=computed,
              expected_computed=expected, prefix_hit_tokens=after.prefix_hit_tokens - before.prefix_hit_tokens,
              ok=len(set(texts)) == 3 and computed == expected and [c.index for c in reply.choices] == [0, 1, 2])

    every = client.completions.create(n=4, logprobs=0, **common)
    totals = [sum(c.logprobs.token_logprobs) for c in every.choices]
    best_i = max(range(4), key=lambda i: totals[i])
    best = client.completions.create(n=1, best_of=4, logprobs=0, **common)
    single = client.completions.create(n=1, **{**common, "seed": seed + 2})  # sample 2 alone: seed + 2
    best_of = dict(cumulative_logprobs=[round(t, 4) for t in totals], best_index=best_i,
                   best_text=every.choices[best_i].text, best_of_text=best.choices[0].text,
                   best_of_completion_tokens=best.usage.completion_tokens,
                   sample2_alone_matches=single.choices[0].text == every.choices[2].text,
                   ok=best.choices[0].text == every.choices[best_i].text and len(best.choices) == 1)
    return dict(n3=n3, best_of=best_of)


def _schema_request(client: Any, i: int, stream: bool) -> dict:
    import jsonschema
    import openai

    name, prompt, schema = CASES[i]
    fmt = {"type": "json_schema", "json_schema": {"name": f"case_{i}", "schema": schema, "strict": True}}
    args = dict(model=MODEL, messages=[{"role": "user", "content": prompt}], response_format=fmt,
                max_tokens=SCHEMA_MAX_TOKENS, temperature=0)
    start = time.perf_counter()
    out: dict[str, Any] = dict(case=i, name=name, stream=stream)
    try:
        if stream:
            content, finish, tokens = "", None, None
            for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **args):
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
                for choice in chunk.choices:
                    content += choice.delta.content or ""
                    finish = choice.finish_reason or finish
        else:
            reply = client.chat.completions.create(**args)
            content, finish = reply.choices[0].message.content, reply.choices[0].finish_reason
            tokens = reply.usage.completion_tokens
    except openai.APIError as exc:
        out.update(ok=False, error=f"{type(exc).__name__}: {exc}", request=args)
        return out
    out.update(latency_s=time.perf_counter() - start, tokens=tokens, finish_reason=finish, content=content)
    try:
        jsonschema.validate(json.loads(content), schema, format_checker=jsonschema.FormatChecker())
        out["ok"] = True
    except (json.JSONDecodeError, jsonschema.ValidationError) as exc:
        out.update(ok=False, error=f"{type(exc).__name__}: {str(exc).splitlines()[0]}", request=args)
    return out


def check_schemas(client: Any) -> dict:
    result = {}
    for stream in (False, True):
        start = time.perf_counter()
        with ThreadPoolExecutor(len(CASES)) as pool:
            rows = list(pool.map(lambda i, s=stream: _schema_request(client, i, s), range(len(CASES))))
        done = [r for r in rows if "latency_s" in r]
        result["streamed" if stream else "not_streamed"] = dict(
            passed=sum(r["ok"] for r in rows), total=len(rows), wall_s=round(time.perf_counter() - start, 2),
            mean_tokens=round(sum(r["tokens"] or 0 for r in done) / max(len(done), 1), 1),
            mean_latency_s=round(sum(r["latency_s"] for r in done) / max(len(done), 1), 2),
            finish_reasons={f: sum(r.get("finish_reason") == f for r in rows) for f in ("stop", "length")},
            replies=rows)
    same = [a["content"] == b["content"] for a, b in zip(result["not_streamed"]["replies"],
                                                          result["streamed"]["replies"], strict=True)]
    result["streamed_equals_not_streamed"] = sum(same)
    return result


def _call_args_ok(call: Any) -> tuple[bool, Any]:
    import jsonschema

    try:
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, TOOLS[0]["function"]["parameters"])
        return call.function.name == "get_weather", args
    except (json.JSONDecodeError, jsonschema.ValidationError) as exc:
        return False, f"{type(exc).__name__}: {exc}"


def _follow_up(client: Any, message: dict, calls: list[dict], stream: bool) -> dict:
    messages = [*WEATHER_Q, message, *({"role": "tool", "tool_call_id": c["id"], "content": TOOL_RESULT}
                                       for c in calls)]
    args = dict(model=MODEL, messages=messages, tools=TOOLS, max_tokens=48, temperature=0)
    if stream:
        content, finish, tool_deltas = "", None, 0
        for chunk in client.chat.completions.create(stream=True, **args):
            for choice in chunk.choices:
                content += choice.delta.content or ""
                tool_deltas += len(choice.delta.tool_calls or [])
                finish = choice.finish_reason or finish
    else:
        reply = client.chat.completions.create(**args)
        content, finish = reply.choices[0].message.content or "", reply.choices[0].finish_reason
        tool_deltas = len(reply.choices[0].message.tool_calls or [])
    return dict(content=content, finish_reason=finish, tool_calls=tool_deltas,
                ok=finish in ("stop", "length") and bool(content.strip()))


def _call(client: Any, choice: str, parallel: bool | None) -> tuple[dict, Any]:
    extra = {} if parallel is None else {"parallel_tool_calls": parallel}
    reply = client.chat.completions.create(model=MODEL, messages=WEATHER_Q, tools=TOOLS, tool_choice=choice,
                                           max_tokens=64, temperature=0, **extra)
    message = reply.choices[0].message
    calls = message.tool_calls or []
    row: dict[str, Any] = dict(finish_reason=reply.choices[0].finish_reason, content=message.content,
                               completion_tokens=reply.usage.completion_tokens,
                               tool_calls=[dict(id=c.id, name=c.function.name, arguments=c.function.arguments)
                                           for c in calls], called=bool(calls))
    row["arguments_valid"] = bool(calls) and all(_call_args_ok(c)[0] for c in calls)
    return row, message


def check_tools(client: Any) -> dict:
    out: dict[str, Any] = {}
    # required, parallel calls allowed (the default): calls are valid; how many the model writes is its choice
    row, _ = _call(client, "required", None)
    row["ok"] = row["arguments_valid"]
    out["required"] = row
    # required with one call (parallel_tool_calls=false), then the follow-up with the tool's result
    row, message = _call(client, "required", False)
    if row["called"]:
        row["follow_up"] = _follow_up(client, message.model_dump(exclude_none=True), row["tool_calls"], False)
    row["ok"] = (row["arguments_valid"] and row["finish_reason"] == "tool_calls"
                 and row.get("follow_up", {}).get("ok", False))
    out["required_single"] = row
    # auto: whether the model calls on its own is reported, not a failure
    row, message = _call(client, "auto", None)
    if row["called"]:
        row["follow_up"] = _follow_up(client, message.model_dump(exclude_none=True), row["tool_calls"], False)
    row["ok"] = row["arguments_valid"] and row["follow_up"]["ok"] if row["called"] else True
    out["auto"] = row

    # streamed (required, one call): tool-call deltas as the client yields them (id/name first, then arguments)
    calls: dict[int, dict] = {}
    finish, content, chunks = None, "", 0
    stream = client.chat.completions.create(model=MODEL, messages=WEATHER_Q, tools=TOOLS, tool_choice="required",
                                            parallel_tool_calls=False, max_tokens=64, temperature=0, stream=True)
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or []:
                chunks += 1
                call = calls.setdefault(delta.index, dict(id=None, name="", arguments=""))
                call["id"] = delta.id or call["id"]
                if delta.function is not None:
                    call["name"] += delta.function.name or ""
                    call["arguments"] += delta.function.arguments or ""
    assembled = [calls[i] for i in sorted(calls)]
    row = dict(finish_reason=finish, content=content or None, tool_calls=assembled, tool_call_chunks=chunks)
    row["same_as_not_streamed"] = ([(c["name"], c["arguments"]) for c in assembled]
                                   == [(c["name"], c["arguments"]) for c in out["required_single"]["tool_calls"]])
    valid = True
    for c in assembled:
        try:
            args = json.loads(c["arguments"])
            valid = valid and c["name"] == "get_weather" and isinstance(args.get("city"), str)
        except json.JSONDecodeError:
            valid = False
    row["arguments_valid"] = bool(assembled) and valid
    if assembled:
        message = {"role": "assistant", "content": None, "tool_calls": [
            {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
            for c in assembled]}
        row["follow_up"] = _follow_up(client, message, assembled, True)
    row["ok"] = row["arguments_valid"] and finish == "tool_calls" and row.get("follow_up", {}).get("ok", False)
    out["required_single_streamed"] = row
    return out


def _hf_logprobs(model: Any, ids: list[int]) -> tuple[list[float], list[float]]:
    """HF's log-softmax at every position but the last: the logprob of the next prompt token, and the top one."""
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    ref = torch.log_softmax(logits, dim=-1)[:-1]
    return ref.gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist(), ref.max(dim=-1).values.tolist()


def check_echo(client: Any, test_client: Any, hf_dir: Path) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    out: dict[str, Any] = {}
    # one prompt alone, then two prompts of other lengths in one request (one batch in the engine)
    for key, prompts in (("single", [ECHO_PROMPT]), ("batched", ECHO_BATCH)):
        reply = client.completions.create(model=MODEL, prompt=prompts if len(prompts) > 1 else prompts[0],
                                          echo=True, logprobs=1, max_tokens=1, temperature=0)
        rows = []
        for prompt, choice in zip(prompts, reply.choices, strict=True):
            ids = test_client.post("/tokenize", json={"model": MODEL, "prompt": prompt}).json()["tokens"]
            lp = choice.logprobs
            served = lp.token_logprobs[:len(ids)]
            served_top = [max(t.values()) if t else None for t in lp.top_logprobs[:len(ids)]]
            ref_tok, ref_top = _hf_logprobs(model, ids)
            diffs = [abs(x - y) for x, y in zip(served[1:], ref_tok, strict=True)]
            top_diffs = [abs(x - y) for x, y in zip(served_top[1:], ref_top, strict=True)]
            rows.append(dict(prompt_tokens=len(ids), echoed_text_ok=choice.text.startswith(prompt),
                             first_is_null=served[0] is None and served_top[0] is None, max_abs_diff=max(diffs),
                             max_abs_diff_top1=max(top_diffs), sum_logprob=sum(served[1:])))
        out[key] = rows
    rows = out["single"] + out["batched"]
    out["prompt_tokens"] = [r["prompt_tokens"] for r in rows]
    out["max_abs_diff"] = max(r["max_abs_diff"] for r in rows)
    out["max_abs_diff_top1"] = max(r["max_abs_diff_top1"] for r in rows)
    out["first_is_null"] = all(r["first_is_null"] for r in rows)
    out["ok"] = (out["first_is_null"] and all(r["echoed_text_ok"] for r in rows)
                 and max(out["max_abs_diff"], out["max_abs_diff_top1"]) <= LOGPROB_TOL)
    return out


# ---------------------------------------------------------------------------------------------------- report

def report(record: dict) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    s, t, e = record["sampling"], record["tools"], record["echo"]
    table = Table(title=f"lmd serve on SmolLM2-135M-Instruct (CPU, fp32) through openai {record['openai_version']}")
    table.add_column("check")
    table.add_column("result")
    table.add_column("ok")
    mark = {True: "[green]yes[/green]", False: "[red]NO[/red]"}
    n3 = s["n3"]
    table.add_row("n=3 completions", f"{n3['distinct']}/3 distinct; computed tokens {n3['computed_tokens']} "
                  f"= prompt {n3['prompt_tokens']} + 3x{(n3['expected_computed'] - n3['prompt_tokens']) // 3} "
                  f"(expected {n3['expected_computed']})", mark[n3["ok"]])
    b = s["best_of"]
    table.add_row("best_of=4, n=1", escape(f"cum. logprobs of n=4: {b['cumulative_logprobs']}; best #{b['best_index']}; "
                  f"best_of returned it: {b['best_of_text'] == b['best_text']}; seed+2 alone = sample 2: "
                  f"{b['sample2_alone_matches']}"), mark[b["ok"]])
    for key in ("not_streamed", "streamed"):
        r = record["schemas"][key]
        table.add_row(f"json_schema x20, {key.replace('_', ' ')}",
                      f"{r['passed']}/{r['total']} parse+validate; mean {r['mean_tokens']} tokens, "
                      f"{r['mean_latency_s']} s/request (20 concurrent, wall {r['wall_s']} s); "
                      f"finish {r['finish_reasons']}", mark[r["passed"] == r["total"]])
    labels = dict(required="tool_choice=required", required_single="required, parallel_tool_calls=false",
                  auto="tool_choice=auto", required_single_streamed="required, one call, streamed")
    for key, label in labels.items():
        r = t[key]
        calls = ", ".join(f"{c['name']}({c['arguments']})" for c in r["tool_calls"])
        if r["content"]:
            calls += f"; content {r['content']!r}"
        follow = r.get("follow_up")
        tail = f" -> follow-up (finish {follow['finish_reason']}): {follow['content']!r}" if follow else ""
        table.add_row(label, escape(f"{len(r['tool_calls'])} call(s) {calls} (finish {r['finish_reason']}){tail}"),
                      mark[r["ok"]])
    table.add_row("echo + logprobs=1", escape(
        f"prompts of {e['prompt_tokens']} tokens (1 alone, 2 in one request); max |lmd - HF fp32 log-softmax| "
        f"{e['max_abs_diff']:.2e} (top-1 alternative {e['max_abs_diff_top1']:.2e}); first token null: "
        f"{e['first_is_null']}"), mark[e["ok"]])
    Console(width=160).print(table)
    for key in ("not_streamed", "streamed"):
        for r in record["schemas"][key]["replies"]:
            if not r["ok"]:
                print(f"FAILED schema case {r['case']} ({r['name']}, {key}): {r.get('error')}\n  request: "
                      f"{json.dumps(r.get('request'))}\n  reply: {r.get('content')!r}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workspace", type=Path, help="a qwen-template SmolLM2 workspace (default: "
                        "/tmp/smollm2-qwen-ws, deployed when missing)")
    parser.add_argument("--hf-dir", type=Path, default=Path("/tmp/smollm2-hf"),
                        help="fp32 HF dir of the GGUF (made when missing); the logprob reference")
    parser.add_argument("--json", action="store_true", help="print the record as JSON instead of the table")
    parser.add_argument("--out", type=Path, help="also write the record as JSON to this file")
    opts = parser.parse_args()

    import openai
    from fastapi.testclient import TestClient

    from lmd.serve.app import create_app
    from lmd.turbomind.engine import Engine

    start = time.perf_counter()
    hf_dir, ws = ensure_model(opts.hf_dir, opts.workspace)
    record: dict[str, Any] = dict(workspace=str(ws), hf_dir=str(hf_dir), openai_version=openai.__version__,
                                  engine_options=ENGINE_OPTIONS)
    timings = {}
    with Engine(ws, **ENGINE_OPTIONS) as engine, TestClient(create_app(engine, MODEL)) as test_client:
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=test_client, max_retries=0)
        for key, run in (("sampling", lambda: check_sampling(client, engine)), ("schemas", lambda: check_schemas(client)),
                         ("tools", lambda: check_tools(client)),
                         ("echo", lambda: check_echo(client, test_client, hf_dir))):
            t0 = time.perf_counter()
            record[key] = run()
            timings[key] = round(time.perf_counter() - t0, 1)
            print(f"{key}: {timings[key]} s", file=sys.stderr)
    record["timings_s"] = timings
    record["wall_s"] = round(time.perf_counter() - start, 1)
    s, sc, t, e = record["sampling"], record["schemas"], record["tools"], record["echo"]
    record["ok"] = bool(s["n3"]["ok"] and s["best_of"]["ok"] and all(
        sc[k]["passed"] == sc[k]["total"] for k in ("not_streamed", "streamed"))
        and all(t[k]["ok"] for k in t) and e["ok"])
    if opts.out:
        opts.out.write_text(json.dumps(record, indent=1, default=str))
    if opts.json:
        print(json.dumps(record, indent=1, default=str))
    else:
        report(record)
        print(f"wall {record['wall_s']} s; all checks pass: {record['ok']}")
    return 0 if record["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
