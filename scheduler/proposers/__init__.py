"""Proposers that run on the host, in the driver's process: n-gram prompt lookup
(``ngram``) and suffix decoding (``suffix`` over ``suffix_tree`` and
``sequence_matches``). Pure Python, like the rest of ``specray.scheduler``."""
