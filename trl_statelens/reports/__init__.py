"""Runs and their reports. :mod:`.runs` is what every recipe does around ``trainer.train()`` (models, data,
evaluations, ``results.json``); ``statelens report`` (:mod:`.pages`) reads run folders (:mod:`.run_folders`) into
tables (:mod:`.tables`) and plots (:mod:`.plots`), and writes ``states.html`` beside them (:mod:`.states_data`
gathers what it shows, :mod:`.states_page` renders it, with its script in ``states_page.js``).
"""
