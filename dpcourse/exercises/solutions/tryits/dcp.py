import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

class Checkpoint:   # both methods are called on every rank and return nothing
    @staticmethod
    def save(model, optimizer, folder):   # write the model's and the optimizer's state into folder
        model_state, optim_state = get_state_dict(model, optimizer)
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=folder)
    @staticmethod
    def load(model, optimizer, folder):   # put both back into a new model and its new optimizer
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, checkpoint_id=folder)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
