"""`liger generate` (`generate.py`) and `liger chat` (`chat.py`): a trained model answering, loaded and
prompted by the generation stage (`liger_cli.generate`) exactly as its run was trained. Commands on top
of the flow: they may import every stage.
"""
