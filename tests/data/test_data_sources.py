import json
import sysconfig
from pathlib import Path

import pytest

from shardwise.data.sources import iter_documents, resolve_source_files, stdlib_source_files


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def test_stdlib_files_exclude_packages_and_tests_and_are_sorted():
    root = Path(sysconfig.get_paths()["stdlib"])
    files = stdlib_source_files()
    relative = [path.relative_to(root).as_posix() for path in files]
    assert "os.py" in relative and "json/decoder.py" in relative
    assert relative == sorted(relative)
    assert all(path.suffix == ".py" for path in files)
    for name in relative:
        parts = set(name.split("/")[:-1])
        assert not parts & {"site-packages", "dist-packages", "test", "tests", "idle_test"}, name
    assert files == stdlib_source_files()


def test_stdlib_capped_corpus_is_deterministic_and_exactly_capped():
    files = resolve_source_files("stdlib")
    first = list(iter_documents(files, max_bytes=30_000))
    second = list(iter_documents(files, max_bytes=30_000))
    assert first == second
    assert sum(len(text.encode("utf-8")) for text in first) == 30_000


def test_directories_are_walked_for_supported_files_sorted(tmp_path):
    write(tmp_path / "b" / "two.md", "two")
    write(tmp_path / "a" / "one.txt", "one")
    write(tmp_path / "a" / "skip.csv", "x,y")
    write(tmp_path / ".hidden" / "secret.txt", "no")
    extra = write(tmp_path / "extra.py", "print(1)")
    files = resolve_source_files(f"{tmp_path}, {extra}")
    assert [path.relative_to(tmp_path).as_posix() for path in files] == ["a/one.txt", "b/two.md", "extra.py"]


def test_missing_path_is_named_with_fix(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(ValueError, match=f"data.source: path '{missing}' does not exist; fix the path or use \"stdlib\""):
        resolve_source_files(str(missing))


def test_directory_without_text_files_is_an_error(tmp_path):
    write(tmp_path / "data.csv", "a,b")
    with pytest.raises(ValueError, match=r"data.source: no .*files found in"):
        resolve_source_files(str(tmp_path))


def test_unsupported_file_type_is_an_error(tmp_path):
    path = write(tmp_path / "data.csv", "a,b")
    with pytest.raises(ValueError, match="unsupported type '.csv'"):
        resolve_source_files(str(path))


def test_text_and_jsonl_documents(tmp_path):
    text = write(tmp_path / "a.txt", "héllo\n")
    lines = [json.dumps({"text": "first"}), "", json.dumps({"body": "x", "text": "second"})]
    jsonl = write(tmp_path / "b.jsonl", "\n".join(lines) + "\n")
    assert list(iter_documents([text, jsonl])) == ["héllo\n", "first", "second"]


def test_jsonl_custom_field_and_missing_field_names_file_and_line(tmp_path):
    jsonl = write(tmp_path / "b.jsonl", '{"body": "one"}\n{"text": "two"}\n')
    assert next(iter_documents([jsonl], text_field="body")) == "one"
    with pytest.raises(ValueError, match=rf"{jsonl}:2 has no field 'body'; set data.text_field"):
        list(iter_documents([jsonl], text_field="body"))


def test_jsonl_invalid_line_names_file_and_line(tmp_path):
    jsonl = write(tmp_path / "b.jsonl", '{"text": "ok"}\nnot json\n')
    with pytest.raises(ValueError, match=rf"{jsonl}:2 is not valid JSON"):
        list(iter_documents([jsonl]))


def test_parquet_documents_and_missing_column(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"content": ["alpha", None, "beta"], "n": [1, 2, 3]}), path)
    assert list(iter_documents([path], text_field="content")) == ["alpha", "beta"]
    with pytest.raises(ValueError, match=r"has no column 'text' \(columns: content, n\); set data.text_field"):
        list(iter_documents([path]))


def test_cap_never_splits_a_character(tmp_path):
    path = write(tmp_path / "a.txt", "ééééé")  # 2 bytes each
    assert list(iter_documents([path], max_bytes=5)) == ["éé"]
