"""4.2f's try-its: answers written apart from the references (see _tryit_variants.py)."""

DCP_SAVE = ('        dcp.save({"model": model_state, "optim": optim_state, "schedule": scheduler.state_dict()},\n'
            "                 checkpoint_id=folder)")   # dcp's reference save

VARIANTS = {
    "dcp": {
        "mistakes": [
            ("the chapter's lines: model and optimizer only", [
                (DCP_SAVE, '        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=folder)'),
                ('state = {"model": model_state, "optim": optim_state, "schedule": scheduler.state_dict()}',
                 'state = {"model": model_state, "optim": optim_state}'),
                ('        scheduler.load_state_dict(state["schedule"])\n', "")], "the warm-up starts over"),
            ("the schedule saved, never put back", [('        scheduler.load_state_dict(state["schedule"])\n', "")],
             "the warm-up starts over"),
            ("only the model and the schedule are saved", [
                (DCP_SAVE, '        dcp.save({"model": model_state, "schedule": scheduler.state_dict()}, checkpoint_id=folder)'),
                ('state = {"model": model_state, "optim": optim_state, "schedule": scheduler.state_dict()}',
                 'state = {"model": model_state, "schedule": scheduler.state_dict()}'),
                ('optim_state_dict=state["optim"]', "optim_state_dict=optim_state")], "step count"),
            ("loaded, never put into the model, optimizer and scheduler", [
                ('        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])\n'
                 '        scheduler.load_state_dict(state["schedule"])\n', "")], "weights are not the ones saved"),
            ("the optimizer's own state_dict saved and loaded", [
                ('{"model": model_state, "optim": optim_state, "schedule"', '{"model": model_state, "optim": optimizer.state_dict(), "schedule"'),
                ('        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])\n',
                 '        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=optim_state)\n'
                 '        optimizer.load_state_dict(state["optim"])\n')],
             "which state dicts name them by the model's parameter names"),
            ("model.state_dict() with torch.save on each rank", [
                ('        model_state, optim_state = get_state_dict(model, optimizer)\n' + DCP_SAVE,
                 '        torch.save(model.state_dict(), f"{folder}/model-{dist.get_rank()}.pt")'),
                ('        model_state, optim_state = get_state_dict(model, optimizer)\n'
                 '        state = {"model": model_state, "optim": optim_state, "schedule": scheduler.state_dict()}\n'
                 '        dcp.load(state, checkpoint_id=folder)\n'
                 '        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])\n'
                 '        scheduler.load_state_dict(state["schedule"])',
                 '        model.load_state_dict(torch.load(f"{folder}/model-{dist.get_rank()}.pt", weights_only=False))')],
             "Error(s) in loading state_dict"),
        ],
        "correct": [
            ("the model_ and optimizer_ forms, one state dict each", [
                ("from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict",
                 "from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,\n"
                 "                                                     set_model_state_dict, set_optimizer_state_dict)"),
                ('        model_state, optim_state = get_state_dict(model, optimizer)\n' + DCP_SAVE,
                 '        dcp.save({"m": get_model_state_dict(model), "o": get_optimizer_state_dict(model, optimizer),\n'
                 '                  "s": scheduler.state_dict()}, checkpoint_id=folder)'),
                ('        model_state, optim_state = get_state_dict(model, optimizer)\n'
                 '        state = {"model": model_state, "optim": optim_state, "schedule": scheduler.state_dict()}\n'
                 '        dcp.load(state, checkpoint_id=folder)\n'
                 '        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])\n'
                 '        scheduler.load_state_dict(state["schedule"])',
                 '        state = {"m": get_model_state_dict(model), "o": get_optimizer_state_dict(model, optimizer),\n'
                 '                 "s": scheduler.state_dict()}\n'
                 '        dcp.load(state, checkpoint_id=folder)\n'
                 '        scheduler.load_state_dict(state["s"])\n'
                 '        set_model_state_dict(model, state["m"])\n'
                 '        set_optimizer_state_dict(model, optimizer, state["o"])')]),
        ],
    },
    "gradient_sync": {
        "mistakes": [
            ("the chapter's loop: each micro-batch's loss divided by their count",
             [("share = len(x) / sum(len(b) for b, _ in micro_batches)", "share = 1 / len(micro_batches)")],
             "each micro-batch counting alike"),
            ("every micro-batch synchronises", [("        model.set_requires_gradient_sync(i == len(micro_batches) - 1)\n", "")],
             "reduce-scattered 3 times"),
            ("the switch on the root only", [("model.set_requires_gradient_sync(i == len(micro_batches) - 1)",
                                              "model.set_requires_gradient_sync(i == len(micro_batches) - 1, recurse=False)")],
             "the root alone, or every unit below it"),
            ("the loss is not weighted", [(" * share)", ")")], "times the right size"),
            ("synchronisation switched off, never back on", [("i == len(micro_batches) - 1", "False")],
             "no reduce-scatter ran"),
            ("the switch set after each backward, not before", [
                ("        model.set_requires_gradient_sync(i == len(micro_batches) - 1)\n"
                 "        share = len(x) / sum(len(b) for b, _ in micro_batches)\n"
                 "        (F.mse_loss(model(x), y) * share).backward()",
                 "        share = len(x) / sum(len(b) for b, _ in micro_batches)\n"
                 "        (F.mse_loss(model(x), y) * share).backward()\n"
                 "        model.set_requires_gradient_sync(i == len(micro_batches) - 1)")],
             "must be set before the backward it applies to"),
        ],
        "correct": [
            ("off before the loop, summed losses over the samples of the step", [
                ("    for i, (x, y) in enumerate(micro_batches):\n"
                 "        model.set_requires_gradient_sync(i == len(micro_batches) - 1)\n"
                 "        share = len(x) / sum(len(b) for b, _ in micro_batches)\n"
                 "        (F.mse_loss(model(x), y) * share).backward()",
                 "    total = sum(len(b) for b, _ in micro_batches)\n"
                 "    model.set_requires_gradient_sync(False)\n"
                 "    for i, (x, y) in enumerate(micro_batches):\n"
                 "        if i + 1 == len(micro_batches):\n"
                 "            model.set_requires_gradient_sync(True)\n"
                 "        F.mse_loss(model(x), y, reduction=\"sum\").div(total * y.shape[1]).backward()")]),
        ],
    },
}
