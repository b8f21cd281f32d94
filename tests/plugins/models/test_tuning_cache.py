from tokenloom.plugins.models import tuning_cache


def test_choices_round_trip_and_a_bad_file_reads_empty(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENLOOM_CACHE", str(tmp_path))
    assert tuning_cache.load("k.json") == {}
    tuning_cache.store("k.json", "a", [1, 2])
    tuning_cache.store("k.json", "b", None)
    assert tuning_cache.load("k.json") == {"a": [1, 2], "b": None}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["k.json"]  # no temp file left
    (tmp_path / "k.json").write_text("{not json")
    assert tuning_cache.load("k.json") == {}
