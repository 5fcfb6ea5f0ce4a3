from gateway.sim.profile import load_profiles, save_profiles


def test_default_caps_follow_sglang():
    profiles = load_profiles()
    assert profiles["mtp"].resolved_max_running_requests == 48
    assert profiles["mtp"].effective_max_running == 24
    assert profiles["plain"].effective_max_running == 28  # the pair's plain server (memory model)


def test_step_time_is_linear_between_points_and_beyond_the_last():
    plain = load_profiles()["plain"]
    mid = (plain.decode_step_s(24) + plain.decode_step_s(32)) / 2
    assert plain.decode_step_s(28) == mid
    assert plain.decode_step_s(256) > plain.decode_step_s(128)


def test_saved_profiles_load_back_identical(tmp_path):
    profiles = load_profiles()
    path = tmp_path / "measured.yaml"
    save_profiles(profiles, path, comment="measured on my box\nsecond line")
    assert path.read_text().startswith("# measured on my box\n# second line\n")
    assert load_profiles(path) == profiles
