"""One mapping of admission errors to HTTP answers, by the error's type (app/api/errors.py, engine/errors.py),
and one presenter-key check (app/api/auth.py). No model, no server."""
import pytest

from app.api.auth import key_matches, require_presenter
from app.api.errors import APIError, admission_error, failure_status
from engine.errors import PromptTooLong, QueueFull, ServiceUnavailable, ShuttingDown


def test_admission_errors_map_by_type_not_by_message():
    too_long = admission_error(PromptTooLong(900, 512), "messages")
    assert (too_long.status, too_long.code, too_long.param) == (400, "context_length_exceeded", "messages")
    assert too_long.message == "prompt has 900 tokens; the limit is 511 (model context 512)"
    plain = admission_error(ValueError("the limit is what it is"), "prompt")   # the words no longer decide
    assert (plain.status, plain.code, plain.param) == (400, None, "prompt")
    full = admission_error(QueueFull("8 requests are already waiting", 3))
    assert (full.status, full.code, full.headers) == (429, "queue_full", {"Retry-After": "3"})
    for e in (ServiceUnavailable("the model is loading"), ShuttingDown("the server is shutting down")):
        answer = admission_error(e)
        assert (answer.status, answer.code, answer.message) == (503, "service_unavailable", str(e))
    assert admission_error(RuntimeError("a bug")) is None
    assert isinstance(PromptTooLong(2, 1), ValueError)     # still a bad prompt to every `except ValueError`


def test_a_failure_after_admission_is_503_only_when_the_server_is_ending():
    assert failure_status(ShuttingDown("server shutting down")) == (503, "service_unavailable")
    assert failure_status(None) == failure_status(RuntimeError("x")) == (500, "server_error")


class FakeRequest:
    def __init__(self, headers: dict):
        self.headers = headers


@pytest.mark.parametrize("wanted, given, ok", [(None, None, True), (None, "x", True), ("s3cret", "s3cret", True),
                                               ("s3cret", None, False), ("s3cret", "S3CRET", False),
                                               ("s3cret", "", False)])
def test_one_presenter_key_check(wanted, given, ok):
    assert key_matches(wanted, given) is ok
    request = FakeRequest({} if given is None else {"x-presenter-key": given})
    if ok:
        require_presenter(request, wanted, "changing the engine")
    else:
        with pytest.raises(APIError) as e:
            require_presenter(request, wanted, "changing the engine")
        assert e.value.status == 403 and e.value.code == "presenter_key_required"
        assert e.value.message == "changing the engine needs the presenter key (X-Presenter-Key header)"
        assert wanted not in e.value.message                   # never echoed
