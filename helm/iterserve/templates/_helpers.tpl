{{/* Names and labels. */}}
{{- define "iterserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "iterserve.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else if contains (include "iterserve.name" .) .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name (include "iterserve.name" .) | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{/* Stable labels, for selectors and pod templates: a label that changes with the chart's
version would change the cluster spec, and KubeRay would replace the whole cluster. */}}
{{- define "iterserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "iterserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "iterserve.labels" -}}
{{ include "iterserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end }}

{{- define "iterserve.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end }}

{{- define "iterserve.apiKeysPath" -}}/etc/iterserve/api-keys/api_keys.yaml{{- end }}
{{- define "iterserve.batchConfigPath" -}}/etc/iterserve/batch/service.yaml{{- end }}

{{/*
The replica bounds when the service autoscales (config.autoscaling, or num_replicas: auto),
as YAML {min, max}; nothing for a fixed count. max_replicas must be given: the app's default,
the host's CPUs divided by replica_num_cpus, means nothing for a fleet of pods. The checks of
AutoscalingConfig that compare two fields are here too, since the values schema cannot say
them: the chart refuses what `iterserve serve` refuses. The defaults below are
AutoscalingConfig's (tests/test_helm.py checks that the two agree).
*/}}
{{- define "iterserve.autoscaling" -}}
{{- $cfg := .Values.config }}
{{- if or (kindIs "map" $cfg.autoscaling) (eq (toString $cfg.num_replicas) "auto") }}
{{- $a := $cfg.autoscaling | default dict }}
{{- if not $a.max_replicas }}
{{- fail "config.autoscaling.max_replicas is required when the service autoscales (config.autoscaling or config.num_replicas: auto): it is the worker group's maxReplicas, the most worker pods (one per replica) the cluster may grow to" }}
{{- end }}
{{- $min := $a.min_replicas | default 1 | int }}
{{- $max := $a.max_replicas | int }}
{{- if lt $max $min }}
{{- fail (printf "config.autoscaling.max_replicas=%d < min_replicas=%d" $max $min) }}
{{- end }}
{{- if lt ($a.window_s | default 30.0 | float64) ($a.decision_period_s | default 5.0 | float64) }}
{{- fail "config.autoscaling.window_s must be >= decision_period_s" }}
{{- end }}
min: {{ $min }}
max: {{ $max }}
{{- end }}
{{- end }}

{{/*
The application's args: config without host and port (Serve's http_options), with
api_keys_file pointing at the mounted Secret. A fixed count is written out (1 when unset);
with autoscaling, num_replicas stays as given (auto, or unset) beside the section.
*/}}
{{- define "iterserve.appArgs" -}}
{{- $args := omit .Values.config "host" "port" }}
{{- if not (include "iterserve.autoscaling" .) }}
{{- $_ := set $args "num_replicas" (.Values.config.num_replicas | default 1) }}
{{- end }}
{{- if .Values.apiKeysSecret }}
{{- $_ := set $args "api_keys_file" (include "iterserve.apiKeysPath" .) }}
{{- end }}
{{- toYaml $args }}
{{- end }}

{{/* Serve's deploy config (ray.serve.schema.ServeDeploySchema), as serveConfigV2. */}}
{{- define "iterserve.serveConfig" -}}
proxy_location: EveryNode
http_options:
  host: {{ .Values.config.host | default "0.0.0.0" | quote }}
  port: {{ .Values.config.port | default 8000 | int }}
applications:
  - name: iterserve
    route_prefix: /
    import_path: deploy.app:app_builder
    args:
      {{- include "iterserve.appArgs" . | nindent 6 }}
{{- end }}

{{/* Environment of every Ray container: deploy/server.py's SERVE_ENV_DEFAULTS (a test
checks they match), and Serve's HTTP proxy as the way in (no direct ingress). */}}
{{- define "iterserve.env" -}}
- name: RAY_SERVE_CONTROL_LOOP_INTERVAL_S
  value: "0.5"
- name: RAY_SERVE_THROUGHPUT_OPTIMIZED
  value: "1"
- name: RAY_SERVE_ENABLE_DIRECT_INGRESS
  value: "0"
{{- end }}

{{- define "iterserve.volumes" -}}
{{- if .Values.apiKeysSecret }}
- name: api-keys
  secret:
    secretName: {{ .Values.apiKeysSecret }}
    items:
      - {key: api_keys.yaml, path: api_keys.yaml}
{{- end }}
{{- if .Values.modelVolume.claimName }}
- name: models
  persistentVolumeClaim:
    claimName: {{ .Values.modelVolume.claimName }}
    readOnly: true
{{- else if .Values.modelVolume.hostPath }}
- name: models
  hostPath:
    path: {{ .Values.modelVolume.hostPath }}
    type: Directory
{{- end }}
{{- if .Values.adapterVolume.claimName }}
- name: adapters
  persistentVolumeClaim:
    claimName: {{ .Values.adapterVolume.claimName }}
    readOnly: true
{{- else if .Values.adapterVolume.hostPath }}
- name: adapters
  hostPath:
    path: {{ .Values.adapterVolume.hostPath }}
    type: Directory
{{- end }}
{{- if .batch }}
- name: batch-data
  persistentVolumeClaim:
    claimName: {{ .Values.batchJob.claimName }}
- name: batch-config
  configMap:
    name: {{ include "iterserve.fullname" . }}-batch-config
{{- end }}
- name: dshm
  emptyDir:
    medium: Memory
{{- end }}

{{- define "iterserve.volumeMounts" -}}
{{- if .Values.apiKeysSecret }}
- name: api-keys
  mountPath: /etc/iterserve/api-keys
  readOnly: true
{{- end }}
{{- if or .Values.modelVolume.claimName .Values.modelVolume.hostPath }}
- name: models
  mountPath: {{ .Values.modelVolume.mountPath }}
  readOnly: true
{{- end }}
{{- if or .Values.adapterVolume.claimName .Values.adapterVolume.hostPath }}
- name: adapters
  mountPath: {{ .Values.adapterVolume.mountPath }}
  readOnly: true
{{- end }}
{{- if .batch }}
- name: batch-data
  mountPath: {{ .Values.batchJob.mountPath }}
- name: batch-config
  mountPath: /etc/iterserve/batch
  readOnly: true
{{- end }}
- name: dshm
  mountPath: /dev/shm
{{- end }}

{{/*
The replicas of a fixed fleet: config.num_replicas (1 when unset). A batch job's fleet is
fixed even when the service autoscales (it has no traffic to scale on): max_replicas then.
*/}}
{{- define "iterserve.fixedReplicas" -}}
{{- $bounds := include "iterserve.autoscaling" . | fromYaml }}
{{- if $bounds }}{{ $bounds.max | int }}{{ else }}{{ .Values.config.num_replicas | default 1 | int }}{{ end }}
{{- end }}

{{/* The batch job's service config (deploy.batch --config): config without host and port,
with a fixed count (iterserve.fixedReplicas) in place of autoscaling. */}}
{{- define "iterserve.batchConfig" -}}
{{- $c := omit .Values.config "host" "port" "autoscaling" }}
{{- $_ := set $c "num_replicas" (include "iterserve.fixedReplicas" . | int) }}
{{- toYaml $c }}
{{- end }}

{{/*
The Ray cluster: a head (Serve's controller and proxy, the dashboard; num-cpus 0, so no
model replica lands there) and one worker pod per model replica. Takes a dict with the
root context as "root" and "batch" (true in the RayJob: its data volume is mounted, and
its fleet is fixed). When the service autoscales, KubeRay's in-tree autoscaler (a sidecar
of the head) adds a worker pod for each replica Serve cannot place, up to max_replicas,
and removes a pod idle for autoscaler.idleTimeoutSeconds (the replica policy's own
cooldown, autoscaling.scale_down_delay_s, has passed by the time a replica goes).
*/}}
{{- define "iterserve.rayCluster" -}}
{{- $root := .root }}
{{- $ctx := merge (dict "batch" .batch) $root }}
{{- $cfg := $root.Values.config }}
{{- $cpus := $cfg.replica_num_cpus | float64 }}
{{- $gpus := $cfg.replica_num_gpus | default 0 | float64 }}
{{- $bounds := include "iterserve.autoscaling" $root | fromYaml }}
{{- $autoscale := and $bounds (not .batch) }}
{{- $as := $root.Values.autoscaler }}
rayVersion: {{ $root.Values.rayVersion | quote }}
{{- if $root.Values.rayAuthToken }}
authOptions:
  mode: token
{{- end }}
{{- if $autoscale }}
enableInTreeAutoscaling: true
autoscalerOptions:
  upscalingMode: {{ $as.upscalingMode }}
  idleTimeoutSeconds: {{ $as.idleTimeoutSeconds | int }}
  imagePullPolicy: {{ $root.Values.image.pullPolicy }}
  resources:
    requests: {cpu: {{ $as.cpu | quote }}, memory: {{ $as.memory | quote }}}
    limits: {cpu: {{ $as.cpu | quote }}, memory: {{ $as.memory | quote }}}
{{- end }}
headGroupSpec:
  rayStartParams:
    dashboard-host: "0.0.0.0"
    num-cpus: "0"
  template:
    metadata:
      labels:
        {{- include "iterserve.selectorLabels" $root | nindent 8 }}
    spec:
      {{- with $root.Values.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $root.Values.head.nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $root.Values.head.tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      containers:
        - name: ray-head
          image: {{ include "iterserve.image" $root }}
          imagePullPolicy: {{ $root.Values.image.pullPolicy }}
          env:
            {{- include "iterserve.env" $root | trim | nindent 12 }}
          ports:
            - {containerPort: 6379, name: gcs-server}
            - {containerPort: 8265, name: dashboard}
            - {containerPort: 10001, name: client}
            - {containerPort: {{ $cfg.port | default 8000 | int }}, name: serve}
          resources:
            requests: {cpu: {{ $root.Values.head.cpu | quote }}, memory: {{ $root.Values.head.memory | quote }}}
            limits: {cpu: {{ $root.Values.head.cpu | quote }}, memory: {{ $root.Values.head.memory | quote }}}
          volumeMounts:
            {{- include "iterserve.volumeMounts" $ctx | trim | nindent 12 }}
      volumes:
        {{- include "iterserve.volumes" $ctx | trim | nindent 8 }}
workerGroupSpecs:
  - groupName: replicas
    {{- if $autoscale }}
    replicas: {{ $bounds.min | int }}
    minReplicas: {{ $bounds.min | int }}
    maxReplicas: {{ $bounds.max | int }}
    {{- else }}
    {{- $n := include "iterserve.fixedReplicas" $root | int }}
    replicas: {{ $n }}
    minReplicas: {{ $n }}
    maxReplicas: {{ $n }}
    {{- end }}
    rayStartParams:
      num-cpus: {{ ceil $cpus | int | quote }}
    template:
      metadata:
        labels:
          {{- include "iterserve.selectorLabels" $root | nindent 10 }}
      spec:
        {{- with $root.Values.imagePullSecrets }}
        imagePullSecrets:
          {{- toYaml . | nindent 10 }}
        {{- end }}
        {{- with $root.Values.worker.nodeSelector }}
        nodeSelector:
          {{- toYaml . | nindent 10 }}
        {{- end }}
        {{- with $root.Values.worker.tolerations }}
        tolerations:
          {{- toYaml . | nindent 10 }}
        {{- end }}
        containers:
          - name: ray-worker
            image: {{ include "iterserve.image" $root }}
            imagePullPolicy: {{ $root.Values.image.pullPolicy }}
            env:
              {{- include "iterserve.env" $root | trim | nindent 14 }}
            ports:
              - {containerPort: {{ $cfg.port | default 8000 | int }}, name: serve}
            resources:
              requests:
                cpu: {{ $cpus | toString | quote }}
                memory: {{ $root.Values.worker.memory | quote }}
                {{- if gt $gpus 0.0 }}
                nvidia.com/gpu: {{ ceil $gpus | int | quote }}
                {{- end }}
              limits:
                cpu: {{ ceil $cpus | int | quote }}
                memory: {{ $root.Values.worker.memory | quote }}
                {{- if gt $gpus 0.0 }}
                nvidia.com/gpu: {{ ceil $gpus | int | quote }}
                {{- end }}
            volumeMounts:
              {{- include "iterserve.volumeMounts" $ctx | trim | nindent 14 }}
        volumes:
          {{- include "iterserve.volumes" $ctx | trim | nindent 10 }}
{{- end }}
