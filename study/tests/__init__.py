"""The study harness's tests (``make test`` runs them beside tests/): small hand-made rows and
plans, and the committed rows of study/results/ where a report or the package's table must equal
what they give."""
