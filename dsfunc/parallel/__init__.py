"""Model parallelism over the mesh's axes: tensor parallelism (:mod:`dsfunc.parallel.tensor`) and its plans
(:mod:`dsfunc.parallel.autotp`)."""
