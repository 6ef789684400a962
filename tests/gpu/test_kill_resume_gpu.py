"""The kill -9 loop of tests/system/test_kill_resume.py on one GPU (issue 63 item 19: a run there ended on its own
before its first checkpoint): kills at random moments and inside checkpoint writes, each followed by --resume
auto, end bit for bit where the uninterrupted run does; every run's exit code and stderr are kept, and a run that
ends otherwise than by the kill fails the test with them."""

import pytest

from tests.system.test_kill_resume import kill_loop

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


def test_kill_9_loop_on_the_gpu_resumes_bit_for_bit(corpus, tmp_path):
    kill_loop(tmp_path, corpus, "cuda")
