"""Built-in agent environments (``--agent NAME``), each ordinary agent code against the
OpenAI client: ``Tasks`` (an endless, seeded task source), ``run(client, sample) -> reward``
and the chat template the environment needs (``None``: the tokenizer's)."""

from . import calculator, chain

BUILTIN = {"calculator": calculator, "chain": chain}
