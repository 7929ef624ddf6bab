"""The grammar compiler's process: errors cut to a line, a bounded wait, a restart after a kill."""

import threading

import pytest

from support_replay.engine.grammar_check import GrammarChecker, first_line
from support_replay.errors import OverloadedError, RequestError
from tiny_model import tiny_tokenizer


def test_an_error_is_cut_to_its_first_line():
    assert first_line('at 2(6): unknown name: "bar"\n   1 | start: foo\n') == 'at 2(6): unknown name: "bar"'
    assert first_line("x" * 1000).endswith("...") and len(first_line("x" * 1000)) == 403
    assert first_line("") == "the grammar does not compile"


@pytest.mark.processes
def test_past_max_waiting_a_compile_is_a_503_and_the_process_serves_the_rest(tmp_path):
    tok = tiny_tokenizer(tmp_path)
    checker = GrammarChecker(tok, 384, [tok.eos_token_id], seconds=30, max_waiting=1)
    try:
        with checker._lock:  # a compile in the process: the next caller waits, the one after it is refused
            waiter = threading.Thread(target=checker.check, args=('start: "a"',))
            waiter.start()
            while checker._waiting < 1:
                threading.Event().wait(0.01)
            with pytest.raises(OverloadedError, match="waiting to be compiled"):
                checker.check('start: "b"')
        waiter.join(60)
        with pytest.raises(RequestError, match="unknown name"):
            checker.check('start: foo\nfoo: "a" | bar\n')
        checker.close()  # as after a kill: the next grammar starts a new process
        checker.check('start: "c"')
    finally:
        checker.close()
