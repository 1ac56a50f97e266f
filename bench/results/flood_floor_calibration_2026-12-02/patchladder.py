from engine.runtime import startup_calibration as sc
sc._prompt_ladder = lambda limit: [16, 64, 256, 1024, 1448, 2048]
