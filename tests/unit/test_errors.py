import inspect
import pickle

import pytest

from elastic import errors

ALL_ERRORS = [
    obj for _, obj in inspect.getmembers(errors, inspect.isclass)
    if issubclass(obj, Exception) and obj.__module__ == errors.__name__
]


def _instance(cls: type[Exception]) -> Exception:
    if issubclass(cls, errors.UserCodeError):
        return cls("loss raised", rank=2, step=7, traceback="Traceback ...")
    if issubclass(cls, errors.CollectiveError):
        return cls("boom", rank=1, generation=3)
    if issubclass(cls, (errors.WorkerLostError, errors._AtRankAndStep)):
        return cls("gone", rank=1, step=4)
    if cls is errors.GenerationOutOfMemoryError:
        return cls("no room", rank=1, generation=5, doing="restoring")
    return cls("message")


def test_every_error_derives_from_elastic_error():
    assert len(ALL_ERRORS) >= 15
    for cls in ALL_ERRORS:
        assert issubclass(cls, errors.ElasticError), cls


@pytest.mark.parametrize("cls", ALL_ERRORS, ids=lambda c: c.__name__)
def test_every_error_pickles_with_its_fields(cls):
    original = _instance(cls)
    copy = pickle.loads(pickle.dumps(original))
    assert type(copy) is cls
    assert str(copy) == str(original)
    assert vars(copy) == vars(original)


@pytest.mark.parametrize("cls", ALL_ERRORS, ids=lambda c: c.__name__)
def test_every_error_documents_its_recovery(cls):
    doc = inspect.getdoc(cls) or ""
    assert doc, cls
    if cls is not errors.ElasticError:
        assert "Recovery" in doc, cls


def test_user_code_error_message_names_rank_step_and_traceback():
    e = errors.UserCodeError("loss raised", rank=2, step=7, traceback="Traceback: ValueError")
    assert "rank 2" in str(e)
    assert "step 7" in str(e)
    assert "ValueError" in str(e)
