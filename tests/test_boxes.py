"""compass_data.boxes (find, scale, draw [x1, y1, x2, y2] on the 0-1000 grid) and generate --draw-boxes."""

from __future__ import annotations

import os
import pathlib
from fractions import Fraction
from types import SimpleNamespace

import pytest
from PIL import Image

from compass_compat import cli
from compass_data.boxes import (
    HALO,
    PALETTE,
    GridBox,
    PixelBox,
    draw_boxes,
    find_boxes,
    format_number,
    pixel_rect,
    scan_boxes,
    to_pixels,
)
from scripts.toy.scoring import iou

# The old demo picture (a compass rose, 320x240 palette PNG): box pixels differ from grid values.
ROSE = pathlib.Path(__file__).resolve().parent / "fixtures" / "compass_rose_320x240.png"

# ------------------------------------------------------------------------- parsing

B = GridBox


@pytest.mark.parametrize(
    "text, boxes",
    [
        ("[120, 80, 560, 900]", [B(120, 80, 560, 900)]),
        ("[120,80,560,900]", [B(120, 80, 560, 900)]),
        ("[ 120 ,80,\n  560 ,\t900 ]", [B(120, 80, 560, 900)]),
        ("The cat [10, 20, 30, 40] sits left of the dog [50, 60, 70, 80].", [B(10, 20, 30, 40), B(50, 60, 70, 80)]),
        ("cat[10, 20, 30, 40]dog", [B(10, 20, 30, 40)]),
        ('{"label": "cat", "bbox_2d": [10, 20, 30, 40]}', [B(10, 20, 30, 40)]),
        (
            '```json\n[{"bbox_2d": [10, 20, 30, 40], "label": "a"}, {"bbox_2d": [0, 0, 1000, 1000], "label": "b"}]\n```',
            [B(10, 20, 30, 40), B(0, 0, 1000, 1000)],
        ),
        ("[[10, 20, 30, 40], [50, 60, 70, 80]]", [B(10, 20, 30, 40), B(50, 60, 70, 80)]),
        ("[[[10, 20, 30, 40]]]", [B(10, 20, 30, 40)]),
        ("[[10, 20, 30, 40]", [B(10, 20, 30, 40)]),  # unbalanced outer bracket: the inner list still counts
        ("[10.5, 20, 30.25, 40]", [B(10.5, 20, 30.25, 40)]),
        ("[.5, 0, 1., 2]", [B(0.5, 0, 1, 2)]),
        ("[007, 0, 10, 10]", [B(7, 0, 10, 10)]),
        ("[0, 0, 1000, 1000]", [B(0, 0, 1000, 1000)]),  # the edges of the grid are in
        (
            "[500, 100, 500, 200] [100, 500, 200, 500]",
            [B(500, 100, 500, 200), B(100, 500, 200, 500)],
        ),  # zero width/height
        ("[1, 2, 3, 4] again [1, 2, 3, 4]", [B(1, 2, 3, 4), B(1, 2, 3, 4)]),  # duplicates kept, in order
        ("[2019, 2020, 2021, 2022] then [10, 20, 30, 40]", [B(10, 20, 30, 40)]),  # rejected ones do not hide the rest
        ("[600, 80, 120, 900] and [120, 80, 560, 900]", [B(120, 80, 560, 900)]),
        # not boxes at all
        ("", []),
        ("no boxes here", []),
        ("see [1] and [1, 2, 3]", []),
        ("[1, 2, 3, 4, 5]", []),
        ("[1, 2, 3, 4, 5, 6, 7, 8]", []),  # eight numbers are not two boxes
        ('["a", 1, 2, 3]', []),
        ("[x1, y1, x2, y2]", []),
        ("[1 2 3 4]", []),  # commas are required
        ("[1, 2, 3, 4,]", []),
        ("[1,, 2, 3, 4]", []),
        ("[1e2, 0, 10, 10]", []),
        ("(10, 20, 30, 40)", []),  # square brackets only
        ("10, 20, 30, 40]", []),
        ("[10, 20, 30, 40", []),
        ("[١٠, 20, 30, 40]", []),  # ASCII digits only
        # values or order the grid does not allow
        ("[1001, 0, 1000, 10]", []),
        ("[0, 0, 10, 1000.5]", []),
        ("[-1, 0, 10, 10]", []),
        ("[600, 80, 120, 900]", []),
        ("[120, 900, 560, 80]", []),
    ],
)
def test_find_boxes(text, boxes):
    assert find_boxes(text) == boxes


@pytest.mark.parametrize(
    "text, problems",
    [
        ("[10, 20, 30, 40]", [None]),
        ("[1001, 0, 1000, 10]", ["1001 is outside 0..1000"]),
        ("[0, -2.5, 10, 10]", ["-2.5 is outside 0..1000"]),
        ("[600, 80, 120, 900]", ["x1 > x2 (600 > 120)"]),
        ("[120, 900, 560, 80.5]", ["y1 > y2 (900 > 80.5)"]),
        (
            "[2019, 2020, 2021, 2022] [5, 5, 1, 1] [0, 0, 1, 1] [1, 2, 3]",
            ["2019 is outside 0..1000", "x1 > x2 (5 > 1)", None],
        ),
    ],
)
def test_scan_boxes_says_why_a_list_is_rejected(text, problems):
    matches = scan_boxes(text)
    assert [m.problem for m in matches] == problems
    for m in matches:
        bracket = text[m.start : m.end]
        assert bracket.startswith("[") and bracket.endswith("]")
        assert m.values == tuple(float(v) for v in bracket[1:-1].split(","))
        assert m.box == (GridBox(*m.values) if m.problem is None else None)


# ------------------------------------------------------------------------- scaling


def _exact(value: int, size: int) -> float:
    return float(Fraction(value * size, 1000))


@pytest.mark.parametrize("size", [(320, 240), (501, 379), (640, 480), (1, 1), (7, 3), (4000, 3000)])
@pytest.mark.parametrize("box", [(0, 0, 1000, 1000), (120, 80, 560, 900), (333, 1, 667, 999), (500, 500, 500, 500)])
def test_to_pixels_is_value_times_size_over_1000(box, size):
    w, h = size
    got = to_pixels(GridBox(*box), size)
    assert isinstance(got, PixelBox)
    assert got == (_exact(box[0], w), _exact(box[1], h), _exact(box[2], w), _exact(box[3], h))


@pytest.mark.parametrize(
    "box, size, pixels",
    [
        ((0, 0, 1000, 1000), (501, 379), (0, 0, 501, 379)),  # 1000 is the far edge: width, not width - 1
        ((500, 500, 500, 500), (501, 379), (250.5, 189.5, 250.5, 189.5)),
        ((100, 200, 600, 900), (320, 240), (32, 48, 192, 216)),
        ((333, 0, 667, 1000), (640, 480), (213.12, 0, 426.88, 480)),
        ((12.5, 0, 1000, 1000), (320, 240), (4, 0, 320, 240)),
    ],
)
def test_to_pixels_by_hand(box, size, pixels):
    assert to_pixels(GridBox(*box), size) == pixels


@pytest.mark.parametrize(
    "box, size, rect",
    [
        ((0, 0, 1000, 1000), (320, 240), (0, 0, 319, 239)),
        ((0, 0, 0, 0), (320, 240), (0, 0, 0, 0)),  # zero size still covers one pixel
        ((1000, 1000, 1000, 1000), (320, 240), (319, 239, 319, 239)),
        ((100, 200, 600, 900), (320, 240), (32, 48, 191, 215)),  # [32, 192) is columns 32..191
        ((333, 0, 667, 1000), (640, 480), (213, 0, 426, 479)),  # 213.12 .. 426.88: every pixel touched
        ((0, 0, 1000, 1000), (1, 1), (0, 0, 0, 0)),
    ],
)
def test_pixel_rect_is_the_inclusive_pixels_touched(box, size, rect):
    assert pixel_rect(GridBox(*box), size) == rect


def test_pixel_rect_stays_inside_the_image_and_covers_the_box():
    for w, h in [(1, 1), (7, 3), (320, 240), (501, 379)]:
        for x1 in range(0, 1001, 37):
            for x2 in range(x1, 1001, 53):
                left, top, right, bottom = pixel_rect(GridBox(x1, x1 * 0.5, x2, x2), (w, h))
                assert 0 <= left <= right <= w - 1 and 0 <= top <= bottom <= h - 1
                lo, hi = Fraction(x1 * w, 1000), Fraction(x2 * w, 1000)
                assert left <= lo and (right + 1 >= hi)  # every touched column is in
                assert lo < left + 1 or left == w - 1  # and the first column really is touched


@pytest.mark.parametrize("size", [(0, 10), (10, -1), (10.0, 10), (10, "10")])
def test_scaling_refuses_a_bad_size(size):
    with pytest.raises(ValueError, match="positive ints"):
        to_pixels(GridBox(0, 0, 1, 1), size)


@pytest.mark.parametrize(
    "value, text", [(12.0, "12"), (12.5, "12.5"), (76.8125, "76.81"), (0.0, "0"), (-0.001, "0"), (1000.0, "1000")]
)
def test_format_number(value, text):
    assert format_number(value) == text


# ------------------------------------------------------------------------- drawing

GRAY = (100, 110, 120)


def _gray(size=(100, 80), color=GRAY, mode="RGB") -> Image.Image:
    return Image.new(mode, size, color)


def test_draw_boxes_outlines_a_copy_and_leaves_the_rest():
    image = _gray()
    before = image.tobytes()
    box = GridBox(200, 250, 600, 750)  # pixels x 20..59, y 20..59 on 100x80
    assert pixel_rect(box, image.size) == (20, 20, 59, 59)
    out = draw_boxes(image, [box], stroke=2)
    assert out is not image and image.tobytes() == before and image.mode == "RGB"
    assert out.size == image.size and out.mode == "RGB"
    px = out.load()
    # A cross-section through the left edge at y = 40: outer halo, 2 px of colour, inner halo.
    assert [px[x, 40] for x in range(17, 25)] == [GRAY, GRAY, HALO, PALETTE[0], PALETTE[0], HALO, GRAY, GRAY]
    # The same through the bottom edge at x = 40 (rows 57..59 are inside the box, 60 outside).
    assert [px[40, y] for y in range(55, 63)] == [GRAY, GRAY, HALO, PALETTE[0], PALETTE[0], HALO, GRAY, GRAY]
    for corner in [(20, 20), (59, 20), (20, 59), (59, 59)]:
        assert px[corner] == PALETTE[0]
    changed = {(x, y) for x in range(100) for y in range(80) if px[x, y] != GRAY}
    # Exactly the ring from the outer halo (19..60) to the inner halo (22..57), nothing else.
    ring = {(x, y) for x in range(19, 61) for y in range(19, 61) if not (23 <= x <= 56 and 23 <= y <= 56)}
    assert changed == ring


@pytest.mark.parametrize("background", [(0, 0, 0), (255, 255, 255), PALETTE[0], (128, 128, 128), (0, 255, 0)])
def test_every_stroke_shows_on_any_background(background):
    image = _gray(color=background)
    out = draw_boxes(image, [GridBox(200, 250, 600, 750), GridBox(100, 100, 900, 900)])
    px = out.load()
    for left in (20, 10):  # the two boxes' left edges
        section = [px[x, 40] for x in range(left - 1, left + 4)]
        contrast = max(max(abs(a - b) for a, b in zip(p, background)) for p in section)
        assert contrast >= 120, (background, section)  # mid-gray allows 128 at most
    assert px[0, 0] == background and px[40, 40] == background
    assert len({px[20, 40], px[10, 40]} - {HALO}) == 2, "each box has its own colour"


def test_a_full_image_box_draws_on_the_border_pixels():
    out = draw_boxes(_gray(), [GridBox(0, 0, 1000, 1000)], stroke=2)
    px = out.load()
    assert px[0, 40] == px[99, 40] == px[50, 0] == px[50, 79] == PALETTE[0]
    assert px[2, 40] == HALO and px[3, 40] == GRAY and px[50, 40] == GRAY


def test_labels_go_in_a_tag_above_the_box_or_inside_it():
    image = _gray()
    boxes = [GridBox(200, 500, 600, 900), GridBox(100, 0, 900, 300)]  # room above the first, none above the second
    plain = draw_boxes(image, boxes, stroke=2)
    tagged = draw_boxes(image, boxes, ["1", "2"], stroke=2)
    diff = [(x, y) for x in range(100) for y in range(80) if plain.getpixel((x, y)) != tagged.getpixel((x, y))]
    left1, top1 = pixel_rect(boxes[0], image.size)[:2]  # (20, 40)
    left2, top2 = pixel_rect(boxes[1], image.size)[:2]  # (10, 0)
    tag1 = [(x, y) for x, y in diff if y > 20]
    tag2 = [(x, y) for x, y in diff if y <= 20]
    # Tag 1 sits on box 1's outer black line (row top1 - 1), starting at its left halo column.
    assert max(y for _, y in tag1) == top1 - 2 and min(x for x, _ in tag1) == left1 - 1
    # Box 2 touches the top edge: its tag goes inside, just below the stroke and inner halo.
    assert min(y for _, y in tag2) == top2 + 2 + 1 and min(x for x, _ in tag2) >= left2
    for tag, color in [(tag1, PALETTE[0]), (tag2, PALETTE[1])]:  # filled with the box's colour, black text and edge
        colors = {tagged.getpixel(p) for p in tag}
        assert color in colors and HALO in colors
    assert tagged.getpixel((99, 79)) == GRAY
    assert draw_boxes(image, boxes, [None, ""], stroke=2).tobytes() == plain.tobytes()
    with pytest.raises(ValueError, match="1 labels for 2 boxes"):
        draw_boxes(image, boxes, ["only one"])


def test_draw_boxes_modes_and_no_boxes():
    demo = Image.open(ROSE)  # a palette ("P") PNG
    before = demo.tobytes()
    out = draw_boxes(demo, [GridBox(100, 100, 200, 200)])
    assert demo.mode == "P" and demo.tobytes() == before
    assert out.mode == "RGB" and out.getpixel((300, 200)) == demo.convert("RGB").getpixel((300, 200))

    rgba = _gray(color=(10, 20, 30, 40), mode="RGBA")
    out = draw_boxes(rgba, [GridBox(200, 250, 600, 750)], stroke=2)
    assert out.mode == "RGBA" and out.getpixel((0, 0)) == (10, 20, 30, 40)
    assert out.getpixel((20, 40)) == PALETTE[0] + (255,)
    assert draw_boxes(_gray(mode="L", color=7), [GridBox(0, 0, 10, 10)]).mode == "RGB"

    empty = draw_boxes(demo, [])
    assert empty is not demo and empty.tobytes() == demo.convert("RGB").tobytes()
    with pytest.raises(ValueError, match="stroke"):
        draw_boxes(_gray(), [GridBox(0, 0, 10, 10)], stroke=0)


# ---------------------------------------------------------------------- the CLI flag


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    """One COMPASS_COMPAT_HOME for the module: the default checkpoint is built once."""
    return tmp_path_factory.mktemp("home")


@pytest.fixture
def generated(monkeypatch, home):
    """Make mlx_vlm.stream_generate yield ``generated.chunks`` (model, processor and prompt are the real ones).

    The answers (and the 320x240 default picture) are fixed here; everything else in ``generate`` runs
    as usual.
    """
    import mlx_vlm

    monkeypatch.setenv("COMPASS_COMPAT_HOME", str(home))
    # A 320x240 default picture, so pixels differ from grid values.
    monkeypatch.setattr(cli.generate, "DEMO_IMAGE", ROSE)
    state = SimpleNamespace(chunks=[], calls=[])

    def fake_stream_generate(model, processor, prompt, image=None, **kwargs):
        state.calls.append({"prompt": prompt, "image": image, **kwargs})
        for n, chunk in enumerate(state.chunks, 1):
            yield SimpleNamespace(
                text=chunk, prompt_tokens=95, prompt_tps=1.0, generation_tokens=n, generation_tps=1.0, peak_memory=0.0
            )

    monkeypatch.setattr(mlx_vlm, "stream_generate", fake_stream_generate)
    return state


def run(capsys, *argv):
    code = cli.main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


ANSWER = "The compass is at [100, 2", '00, 600, 900] and the sun at {"bbox_2d": [700,50, 950 , 400]}.'


def test_draw_boxes_end_to_end(generated, capsys, tmp_path):
    generated.chunks = list(ANSWER)  # a box split across chunks is found in the joined text
    target = tmp_path / "boxes.png"
    code, out, err = run(capsys, "generate", "--prompt", "Where are the compass and the sun?", "--draw-boxes", target)
    assert code == 0, err
    assert generated.calls[0]["image"] == [str(cli.generate.DEMO_IMAGE)]
    assert "".join(ANSWER) + "\n" in out
    report = out.split("=" * 10 + "\n")[-1].splitlines()
    assert report == [
        f"Boxes: 2 found in the text (0-1000 grid) -> pixels of {cli.generate.DEMO_IMAGE} (320x240):",
        "  1: [100, 200, 600, 900] -> (32, 48, 192, 216)",
        "  2: [700, 50, 950, 400] -> (224, 12, 304, 96)",
        f"Wrote {target}: a copy of the image with the 2 boxes, labelled as numbered above",
    ]
    demo = Image.open(cli.generate.DEMO_IMAGE).convert("RGB")
    drawn = Image.open(target)
    assert drawn.size == (320, 240)
    assert drawn.getpixel((32, 120)) == PALETTE[0] and drawn.getpixel((224, 60)) == PALETTE[1]
    assert drawn.getpixel((31, 120)) == HALO
    for far in [(5, 230), (315, 230), (100, 130), (260, 50)]:
        assert drawn.getpixel(far) == demo.getpixel(far)
    boxes = [GridBox(100, 200, 600, 900), GridBox(700, 50, 950, 400)]
    assert drawn.tobytes() == draw_boxes(demo, boxes, ["1", "2"]).tobytes()  # what the library draws


def test_no_verbose_keeps_stdout_to_the_text(generated, capsys, tmp_path):
    generated.chunks = ["[10, 20, 30, 40]"]
    code, out, err = run(capsys, "generate", "--no-verbose", "--draw-boxes", tmp_path / "b.png")
    assert code == 0 and out == "[10, 20, 30, 40]\n"
    assert (
        "[compass-compat] Boxes: 1 found" in err
        and "[compass-compat]   1: [10, 20, 30, 40] -> (3.2, 4.8, 9.6, 9.6)" in err
    )


def test_no_boxes_writes_an_unannotated_copy_and_says_so(generated, capsys, tmp_path):
    generated.chunks = ["There is no compass. [1, 2, 3] [1200, 0, 10, 10] [30, 0, 20, 10]"]
    target = tmp_path / "none.png"
    Image.new("RGB", (5, 5), (1, 2, 3)).save(target)  # a stale result from an earlier run
    code, out, err = run(capsys, "generate", "--draw-boxes", target)
    assert code == 0, err
    assert out.split("=" * 10 + "\n")[-1].splitlines() == [
        "Boxes: none found in the text (no [x1, y1, x2, y2] list on the 0-1000 grid)",
        "  ignored [1200, 0, 10, 10]: 1200 is outside 0..1000",
        "  ignored [30, 0, 20, 10]: x1 > x2 (30 > 20)",
        f"Wrote {target}: an unannotated copy of {cli.generate.DEMO_IMAGE} (320x240)",
    ]
    assert Image.open(target).tobytes() == Image.open(cli.generate.DEMO_IMAGE).convert("RGB").tobytes()


def test_several_images_draw_on_the_first_unless_told(generated, capsys, tmp_path, fixture_images):
    first, second = fixture_images["synth_320x256.png"], fixture_images["synth_640x480.png"]
    generated.chunks = ["[0, 0, 500, 500]"]
    code, out, err = run(capsys, "generate", "--image", first, second, "--draw-boxes", tmp_path / "a.png")
    assert code == 0, err
    assert f"pixels of {first} (320x256, image 0 of 2):" in out and "  1: [0, 0, 500, 500] -> (0, 0, 160, 128)" in out
    assert "Drew on the first of 2 images; --box-image-index N picks another" in out
    assert Image.open(tmp_path / "a.png").size == (320, 256)

    code, out, err = run(
        capsys,
        "generate",
        "--image",
        first,
        "--image",
        second,
        "--draw-boxes",
        tmp_path / "b.png",
        "--box-image-index",
        "1",
    )
    assert code == 0, err
    assert f"pixels of {second} (640x480, image 1 of 2):" in out and "  1: [0, 0, 500, 500] -> (0, 0, 320, 240)" in out
    assert "Drew on the first" not in out
    assert Image.open(tmp_path / "b.png").size == (640, 480)


def test_real_generation_on_the_default_checkpoint(capsys, tmp_path, monkeypatch, home):
    """No fake: the tiny random model's own text goes through the flag (it holds no box)."""
    from compass_data.boxes import find_boxes as find

    monkeypatch.setenv("COMPASS_COMPAT_HOME", str(home))
    target = tmp_path / "real.png"
    code, out, err = run(capsys, "generate", "--max-tokens", "6", "--no-verbose", "--draw-boxes", target)
    assert code == 0, err
    assert out.strip() and target.is_file()
    count = len(find(out))
    assert (f"Boxes: {count} found" if count else "Boxes: none found") in err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--no-image", "--draw-boxes", "{tmp}/o.png"], "--draw-boxes needs an image to draw on; drop --no-image"),
        (["--draw-boxes", "{tmp}/missing/o.png"], "--draw-boxes {tmp}/missing/o.png: folder not found: {tmp}/missing"),
        (["--draw-boxes", "{tmp}/file.txt/o.png"], "not a folder: {tmp}/file.txt"),
        (["--draw-boxes", "{tmp}/folder.png"], "--draw-boxes {tmp}/folder.png: is a folder"),
        (["--draw-boxes", "{tmp}/o.txt"], "name an image file Pillow can write (.png, .jpg, ...)"),
        (["--draw-boxes", "{tmp}/o"], "name an image file Pillow can write"),
        (
            ["--draw-boxes", "{tmp}/o.png", "--box-image-index", "1"],
            "--box-image-index 1: out of range for 1 image (0 is the first)",
        ),
        (["--draw-boxes", "{tmp}/o.png", "--box-image-index", "-1"], "--box-image-index -1: out of range"),
        (["--box-image-index", "0"], "--box-image-index needs --draw-boxes"),
    ],
)
def test_flag_errors_come_before_the_model_loads(generated, capsys, tmp_path, monkeypatch, argv, message):
    import mlx_vlm

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the flags were checked")

    monkeypatch.setattr(mlx_vlm, "load", no_load)
    (tmp_path / "file.txt").write_text("x")
    (tmp_path / "folder.png").mkdir()
    argv = [a.format(tmp=tmp_path) for a in argv]
    code, out, err = run(capsys, "generate", *argv)
    assert code == 2, (out, err)
    assert err.startswith("python -m compass_compat generate: error: ") and message.format(tmp=tmp_path) in err, err
    assert "Traceback" not in err and not generated.calls


def test_a_failed_write_is_an_error(generated, capsys, tmp_path):
    generated.chunks = ["[10, 20, 30, 40]"]
    target = tmp_path / "dangling.png"
    os.symlink(tmp_path / "gone" / "x.png", target)  # passes the checks, fails when written
    code, out, err = run(capsys, "generate", "--draw-boxes", target)
    assert code == 2
    assert f"python -m compass_compat generate: error: --draw-boxes {target}: could not write it:" in err


def test_iou_by_hand():
    assert iou((0, 0, 10, 10), (5, 0, 15, 10)) == pytest.approx(50 / 150)  # half overlap
    assert iou(GridBox(0, 0, 10, 10), (0, 0, 10, 10)) == 1.0
    assert iou((0, 0, 10, 10), (10, 0, 20, 10)) == 0.0  # touching edges
    assert iou((0, 0, 0, 0), (0, 0, 0, 0)) == 0.0  # empty union
