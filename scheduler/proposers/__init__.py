"""Every proposer behind one contract (``proposer.Proposer``): n-gram prompt lookup
(``ngram``), suffix decoding (``suffix`` over ``suffix_tree`` and ``sequence_matches``),
which run in the driver's process; a model merged with suffix decoding per sequence
(``merged``); and the driver's side of a proposer in the target's process
(``in_target``). Pure Python, like the rest of ``specray.scheduler``."""
