"""The prompt sets of ``specray bench``, as token ids every configuration shares.

- ``code``: snippets of the standard library files the built-in pair never trained on
  (``stdlib_corpus``), cut mid-code for the model to continue.
- ``quote``: requests to rewrite a paragraph that the prompt quotes in full (passive
  voice, spelling, names): the answer repeats much of the prompt, where prompt lookup
  (``proposer="ngram"``) pays. For a model with a chat template the request is the user's
  turn of a chat; otherwise plain text.
- ``mixed``: the two alternating, so every batch of two or more holds requests where
  speculation pays (quotes) beside ones where it pays less (code): the workload a
  per-sequence speculation policy exists for.
- ``repeat``: the ``code`` prompts, each asked ``REPEATS`` times in a row (best-of-n,
  retries): the traffic suffix decoding learns from. Rotated repeats at batch 1 meet
  each prompt ``REPEATS`` times running.

Text is encoded as specray encodes a string prompt (``model_loader.encode_prompt``), so
the bench measures what a user's strings get.
"""

from __future__ import annotations

PROMPT_SETS = ("code", "quote", "mixed", "repeat")
REPEATS = 4

INSTRUCTIONS = (
    "Rewrite the following paragraph in the passive voice, keeping every detail:",
    "Correct the spelling mistakes in the following text and give it back in full:",
    "Repeat the following paragraph, replacing every name in it with the name Alex:",
    "Rewrite the following paragraph in the past tense:",
)

PARAGRAPHS = (
    "The gardener waters the roses every morning before the sun rises over the hill. Then she cuts the "
    "dead flowers, feeds the old dog that sleeps by the gate, and carries a basket of apples to the "
    "kitchen, where her brother bakes bread for the whole village.",
    "Our team builds the new bridge across the river this summer. The engineers test the steel beams, the "
    "workers pour the concrete at night when the air is cool, and the city council opens the road to "
    "traffic as soon as the inspectors approve the final design.",
    "Maria writes a letter to her grandmother every Sunday. She tells her about the school, the long walk "
    "through the park, and the small cafe where Daniel and Sofia meet her after class to share a pot of "
    "tea and talk about the books they read that week.",
    "The comittee recieved the report on Tuesday and decided to postpone the meeting untill the folowing "
    "week, because several members were abroad and the budget figures had not been checked by the "
    "accountant, who was ill at the time.",
    "The museum opens a new exhibition about the history of the railway. Visitors see the first steam "
    "engine, read the diaries of the drivers, and listen to recordings of the stations, while guides "
    "explain how the trains changed the lives of the people in the valley.",
    "Thomas repairs old clocks in a small shop near the harbour. Every customer brings a story with the "
    "clock, and Thomas listens carefully before he opens the case, cleans the gears, replaces the broken "
    "spring and sets the hands to the right time again.",
    "The students plant trees along the river every spring. Their teacher shows them how to dig the holes, "
    "the parents bring water in large buckets, and the mayor visits the school in June to thank the "
    "children for their work.",
    "Yesterday the wether was so bad that the ferry did not leave the port. The passengers waited in the "
    "harbour cafe for hours, and the captian finally anounced that the crossing was cancelled until the "
    "wind calmed down.",
)


def quote_texts(count: int) -> list[str]:
    """``count`` rewrite requests, each quoting one paragraph in full."""
    pairs = [(i, p) for p in PARAGRAPHS for i in INSTRUCTIONS]
    # Interleaved so the first few already mix instructions and paragraphs.
    order = [pairs[(j * (len(INSTRUCTIONS) + 1)) % len(pairs)] for j in range(len(pairs))]
    return [f"{order[j % len(order)][0]}\n\n{order[j % len(order)][1]}" for j in range(count)]


def bench_prompts(prompt_set: str, count: int, tokenizer, prompt_bytes: int = 160) -> list[list[int]]:
    """``count`` prompts of ``prompt_set`` as token ids of ``tokenizer``."""
    from specray.workers.model_loader import encode_prompt

    if prompt_set == "code":
        from specray.runtime.bench.stdlib_corpus import held_out_prompts

        return [encode_prompt(tokenizer, t) for t in held_out_prompts(count, prompt_bytes)]
    if prompt_set == "repeat":
        once = bench_prompts("code", -(-count // REPEATS), tokenizer, prompt_bytes)
        return [once[i // REPEATS] for i in range(count)]
    if prompt_set == "mixed":
        quotes = bench_prompts("quote", (count + 1) // 2, tokenizer, prompt_bytes)
        code = bench_prompts("code", count // 2, tokenizer, prompt_bytes)
        return [(quotes if i % 2 == 0 else code)[i // 2] for i in range(count)]
    if prompt_set != "quote":
        raise ValueError(f"prompts must be one of {', '.join(PROMPT_SETS)}, got {prompt_set!r}")
    texts = quote_texts(count)
    if getattr(tokenizer, "chat_template", None):
        chats = [tokenizer.apply_chat_template([{"role": "user", "content": t}], tokenize=False,
                                               add_generation_prompt=True) for t in texts]
        # The template writes its own special tokens (a BOS among them where the model has one).
        return [tokenizer(c, add_special_tokens=False)["input_ids"] for c in chats]
    return [encode_prompt(tokenizer, t + "\n\n") for t in texts]
