// The distributed layer: parallel layouts and their process groups, tensor- and
// vocabulary-parallel layers, pipeline stages and data-parallel training over the communicator,
// checkpoints, and the auto-parallel planner.
#pragma once

#include <tessel/dist/checkpoint.hpp>
#include <tessel/dist/data_parallel.hpp>
#include <tessel/dist/elastic.hpp>
#include <tessel/dist/errors.hpp>
#include <tessel/dist/expert_parallel.hpp>
#include <tessel/dist/grad_check.hpp>
#include <tessel/dist/groups.hpp>
#include <tessel/dist/layout.hpp>
#include <tessel/dist/pipeline.hpp>
#include <tessel/dist/planner.hpp>
#include <tessel/dist/tensor_parallel.hpp>
#include <tessel/dist/timing_step.hpp>
#include <tessel/dist/tp_decoder.hpp>
#include <tessel/dist/vocab_parallel.hpp>
