import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

class Checkpoint:   # both methods are called on every rank and return nothing
    @staticmethod
    def save(model, optimizer, scheduler, folder):   # the model's, optimizer's and schedule's state
        model_state, optim_state = get_state_dict(model, optimizer)
        dcp.save({"model": model_state, "optim": optim_state, "schedule": scheduler.state_dict()},
                 checkpoint_id=folder)
    @staticmethod
    def load(model, optimizer, scheduler, folder):   # all three back into new ones
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optim_state, "schedule": scheduler.state_dict()}
        dcp.load(state, checkpoint_id=folder)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        scheduler.load_state_dict(state["schedule"])
