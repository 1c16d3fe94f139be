"""Streamed text: pieces add up to the whole, partial characters and possible stop strings wait."""

import pytest

from shardwise.generation.text_stream import TextStream


class PiecesTokenizer:
    """Token i decodes to PIECES[i]; a multi-byte character split over two tokens decodes to U+FFFD
    until both are there, as a byte-level BPE decoder does."""

    PIECES = ["Hel", "lo", " wor", "ld", "!", "\xe2\x82", "\xac", " END", "ing"]

    def decode(self, ids):
        raw = "".join(self.PIECES[i] for i in ids).encode("latin-1")
        return raw.decode("utf-8", errors="replace")


def stream_of(ids, stop=()):
    stream = TextStream(PiecesTokenizer(), stop)
    pieces = []
    for token in ids:
        pieces.append(stream.push(token))
        if stream.stopped:
            break
    pieces.append(stream.flush())
    return stream, pieces


def test_pieces_add_up_and_a_split_character_waits_for_its_second_byte():
    stream, pieces = stream_of([0, 1, 2, 3, 5, 6, 4])
    assert "".join(pieces) == stream.text == "Hello world€!"
    assert pieces[4] == ""  # the euro sign's first bytes alone: nothing sent yet
    assert pieces[5] == "€"


@pytest.mark.parametrize("stop, text", [(" world", "Hello"), ("lo w", "Hel"), ("END", "Hello world€ "),
                                        ("€", "Hello world"), ("absent", "Hello world€ ENDing")])
def test_stop_strings_cut_before_them_and_are_never_sent(stop, text):
    stream, pieces = stream_of([0, 1, 2, 3, 5, 6, 7, 8], stop=(stop,))
    assert stream.text == text and "".join(pieces) == text
    assert stream.stopped == (stop != "absent")


def test_a_tail_that_may_become_a_stop_string_is_held_back():
    stream = TextStream(PiecesTokenizer(), (" worXX",))
    assert stream.push(0) == "Hel" and stream.push(1) == "lo"
    assert stream.push(2) == ""        # " wor" may be the start of " worXX"
    assert stream.push(3) == " world"  # it was not
    assert not stream.stopped


def test_the_earliest_of_several_stop_strings_wins():
    stream, pieces = stream_of([0, 1, 2, 3], stop=("ld", "lo"))
    assert stream.text == "Hel"
