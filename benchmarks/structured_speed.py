"""Speculation under a JSON schema: `sd` with the suffix drafter against `ar` on a copy-heavy JSON task.

    python benchmarks/structured_speed.py [--prompts 3] [--max-tokens 128] [--repeats 2]

The reference target on llama.cpp's exact kernels, two Engines open side by side (`ar`, and `sd[suffix]` with its
defaults), each request constrained to the same JSON schema (SamplingParams.structured); the task asks for a JSON
record the prompt already holds with one field changed, so the answer copies most of the prompt (where model-free
drafting pays). Runs are interleaved ar, sd, ar, sd, ... per prompt; prints ms/token of each and their ratio, and
checks every sd answer == ar's and parses against the schema.
"""

from __future__ import annotations

import argparse
import json
import statistics

from paraspec import Engine, SamplingParams

TARGET = "Qwen/Qwen2.5-Coder-1.5B-Instruct"
SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "name": {"type": "string"},
        "email": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string"}, "city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["street", "city", "zip"],
        },
        "active": {"type": "boolean"},
    },
    "required": ["id", "name", "email", "tags", "address", "active"],
}
PEOPLE = [
    (
        17,
        "Ada Lovelace",
        "ada@analytical.example",
        ["math", "engines", "poetry"],
        ("12 St James Square", "London", "SW1Y"),
    ),
    (
        42,
        "Grace Hopper",
        "grace@cobol.example",
        ["compilers", "navy", "debugging"],
        ("1 Ship Lane", "Arlington", "22201"),
    ),
    (
        7,
        "Alan Turing",
        "alan@bletchley.example",
        ["machines", "morphogenesis"],
        ("Bletchley Park", "Milton Keynes", "MK3"),
    ),
    (99, "Edsger Dijkstra", "ewd@austin.example", ["algorithms", "semaphores"], ("2317 Speedway", "Austin", "78712")),
]


def prompt_for(person) -> list[dict]:
    pid, name, email, tags, (street, city, zip_code) = person
    record = {
        "id": pid,
        "name": name,
        "email": email,
        "tags": tags,
        "address": {"street": street, "city": city, "zip": zip_code},
        "active": False,
    }
    text = (
        f"Here is a customer record:\n{json.dumps(record, indent=2)}\n\n"
        f'Return the same record as JSON, unchanged except that "active" is true.'
    )
    return [{"role": "user", "content": text}]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--show", action="store_true", help="print each answer")
    args = parser.parse_args()
    params = SamplingParams(max_new_tokens=args.max_tokens, structured=("json_schema", json.dumps(SCHEMA)))
    times: dict[str, list[float]] = {"ar": [], "sd[suffix]": []}
    with (
        Engine(TARGET, strategy="ar", backend="llamacpp") as ar,
        Engine(TARGET, "suffix", strategy="sd", backend="llamacpp") as sd,
    ):
        for person in PEOPLE[: args.prompts]:
            messages = prompt_for(person)
            for _ in range(args.repeats):
                reference = ar.generate(messages, params)
                mine = sd.generate(messages, params)
                assert mine.token_ids == reference.token_ids, "sd's answer differs from ar's"
                if reference.finish_reason == "stop":
                    json.loads(reference.text)  # the schema's JSON, complete
                times["ar"].append(reference.stats.ms_per_token)
                times["sd[suffix]"].append(mine.stats.ms_per_token)
                if args.show:
                    print(reference.text)
                print(
                    f"{person[1]}: ar {reference.stats.ms_per_token:.1f} ms/token, sd[suffix] "
                    f"{mine.stats.ms_per_token:.1f} (acceptance {mine.stats.acceptance_rate or 0:.2f}), "
                    f"{len(reference.token_ids)} tokens, {reference.finish_reason}",
                    flush=True,
                )
    ar_ms, sd_ms = statistics.mean(times["ar"]), statistics.mean(times["sd[suffix]"])
    print(f"\n| strategy | ms/token | x ar |\n|---|---|---|\n| ar | {ar_ms:.1f} | 1.00 |")
    print(f"| sd[suffix] | {sd_ms:.1f} | {ar_ms / sd_ms:.2f} |")


if __name__ == "__main__":
    main()
