import logging

from sparkdl_avg.tracking.progress import Progress


def test_non_interactive_progress_logs_lines_with_loss_and_accuracy(caplog):
    caplog.set_level(logging.INFO, logger="sparkdl_avg")
    progress = Progress(3, interactive=False)
    for r in range(3):
        progress.update(r, train_loss=1.0 / (r + 1), eval_accuracy=0.5)
    progress.close()
    lines = [rec.getMessage() for rec in caplog.records]
    assert lines[0] == "round 1/3 loss=1.0000 acc=0.500"
    assert lines[-1] == "round 3/3 loss=0.3333 acc=0.500"


def test_interactive_progress_draws_a_bar(capsys):
    progress = Progress(2, interactive=True)
    progress.update(0, 0.5, None)
    progress.update(1, 0.25, None)
    progress.close()
    err = capsys.readouterr().err
    assert "2/2" in err and "loss=0.2500" in err
