"""``specray bench``, as a package: ``run`` (the runs), ``hf_runner`` (Hugging Face's side),
``stats`` (ratios and intervals), ``report`` (the JSON, plot and table), ``prompts`` (the
prompt sets) and ``settings``."""
