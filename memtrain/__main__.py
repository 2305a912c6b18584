from memtrain.cli import app

app()
