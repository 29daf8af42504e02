"""TokenizerPool: requests pinned to replicas, messages split and merged, one replica lost."""

from __future__ import annotations

import pytest

from protos.sluice.v1 import tokenizer_pb2
from services.router import tokenizer_pool
from services.router.tokenizer_pool import TokenizerPool


class FakeClient:
    """Stands in for a TokenizerClient: records what is sent, answers on demand."""

    def __init__(self, address, on_response, on_lost, **options) -> None:  # noqa: ANN001
        self.address = address
        self.on_response = on_response
        self.on_lost = on_lost
        self.sent: list[tokenizer_pb2.DetokenizeRequest] = []
        self.ready = True
        self.ready_changed = None

    def send(self, message: tokenizer_pb2.DetokenizeRequest) -> None:
        self.sent.append(message)

    def answer_all(self) -> None:
        while self.sent:
            message = self.sent.pop(0)
            self.on_response(
                tokenizer_pb2.DetokenizeResponse(
                    sequence_number=message.sequence_number,
                    deltas=[
                        tokenizer_pb2.TextDelta(request_id=u.request_id, text=self.address)
                        for u in message.updates
                    ],
                )
            )

    def lose(self) -> None:
        self.ready = False
        self.sent.clear()
        self.on_lost()


@pytest.fixture
def pool(monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201
    monkeypatch.setattr(tokenizer_pool, "TokenizerClient", FakeClient)
    answers: list[tokenizer_pb2.DetokenizeResponse] = []
    lost: list[tuple[set[str], set[int]]] = []
    created = TokenizerPool(
        ["a:1", "b:2"], answers.append, lambda ids, seqs: lost.append((ids, seqs))
    )
    return created, answers, lost


def message(pool: TokenizerPool, *updates: tuple[str, dict]) -> tokenizer_pb2.DetokenizeRequest:
    built = tokenizer_pb2.DetokenizeRequest(sequence_number=pool.next_sequence_number())
    for request_id, fields in updates:
        built.updates.add(request_id=request_id, **fields)
    return built


def test_requests_are_pinned_round_robin_and_a_split_message_is_answered_once(pool) -> None:  # noqa: ANN001
    pool, answers, _ = pool
    a, b = pool.clients
    first = message(pool, ("r1", {"token_ids": [1]}), ("r2", {"token_ids": [2]}))
    pool.send(first)
    assert [m.updates[0].request_id for m in a.sent] == ["r1"]
    assert [m.updates[0].request_id for m in b.sent] == ["r2"]
    a.answer_all()
    assert answers == []  # half of the message is not an answer
    b.answer_all()
    assert len(answers) == 1 and answers[0].sequence_number == first.sequence_number
    assert {d.request_id: d.text for d in answers[0].deltas} == {"r1": "a:1", "r2": "b:2"}
    # Later messages follow the pins; one replica only: the message goes as it is.
    later = message(pool, ("r1", {"token_ids": [3]}))
    pool.send(later)
    assert a.sent == [later] and not b.sent


def test_losing_a_replica_fails_only_its_requests(pool) -> None:  # noqa: ANN001
    pool, answers, lost = pool
    a, b = pool.clients
    pool.send(message(pool, ("r1", {"token_ids": [1]}), ("r2", {"token_ids": [2]})))
    only_b = message(pool, ("r2", {"token_ids": [5]}))
    pool.send(only_b)
    a.answer_all()
    b.lose()
    assert lost == [({"r2"}, {only_b.sequence_number})]
    assert len(answers) == 1  # the split message finished with the part that came back
    assert [d.request_id for d in answers[0].deltas] == ["r1"]
    assert pool.ready  # one replica is enough
    # New requests go to the replica that is left.
    pool.send(message(pool, ("r3", {"token_ids": [7]})))
    assert a.sent[-1].updates[0].request_id == "r3"
    a.lose()
    assert not pool.ready


def test_finished_and_cancelled_requests_are_unpinned(pool) -> None:  # noqa: ANN001
    pool, answers, lost = pool
    a, _ = pool.clients
    pool.send(message(pool, ("r1", {"token_ids": [1], "finished": True})))
    pool.send(message(pool, ("never-opened", {"cancel": True})))
    assert answers[-1].deltas == []  # nothing to send: answered at once, empty
    a.answer_all()
    a.lose()
    assert lost == [(set(), set())]
