// An MLX metal_kernel body (no signature). The next two lines give its signature to the checker.
// inputs: inp:f32
// outputs: out:f32
// Check it with: ksearch kb check --syntax --input inp:f32 --output out:f32 kb/examples/scale_body.metal
uint i = thread_position_in_grid.x;
if (i >= inp_shape[0]) return;
out[i] = 2.0f * inp[i];
