"""The grammar compiler's own process (``grammar_check.py`` runs this file by path, so it imports llguidance
alone, not this package and torch): it builds the llguidance matcher of each grammar it is sent and answers
its error, or nothing. A compile that runs past its deadline is killed with the process.

Lines on stdin and stdout, each a JSON value: first ``{"tokenizer": <tokenizer.json text>, "n_vocab": int,
"eos": [ids], "memory": bytes}``, answered ``"ready"``; then one grammar string per line, answered with its
error ("" when it compiles)."""

import json
import resource
import sys


def main() -> None:
    import llguidance

    init = json.loads(sys.stdin.readline())
    # its address space bounded (set here: a preexec_fn is not safe in the server's threaded process)
    resource.setrlimit(resource.RLIMIT_AS, (init["memory"], init["memory"]))
    tokenizer = llguidance.LLTokenizer(init["tokenizer"], n_vocab=init["n_vocab"], eos_token=init["eos"])
    answer("ready")
    for line in sys.stdin:
        grammar = json.loads(line)
        try:
            matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
            answer(matcher.get_error() if matcher.is_error() else "")
        except BaseException as exc:  # a Rust panic comes as pyo3's PanicException, a BaseException
            answer(f"{type(exc).__name__}: {exc}" or "the grammar compiler failed")


def answer(value: str) -> None:
    sys.stdout.write(json.dumps(value) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
